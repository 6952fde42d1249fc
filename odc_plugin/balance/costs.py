"""Cost of training on one sequence, as a function of its length.

Balancing only needs costs that are proportional to the time a rank spends on a sequence, so each model
answers "how much work is a sequence of length s" in its own unit (tokens, FLOPs, or whatever unit the
calibration measured).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar


class CostModel(ABC):
    """Work of one sequence from its length; `name` is what get_cost_model and the CLI call it."""

    name: ClassVar[str]

    @abstractmethod
    def __call__(self, seqlen: int) -> float: ...

    def costs(self, seqlens: Sequence[int]) -> list[float]:
        return [self(s) for s in seqlens]


@dataclass(frozen=True)
class TokenCost(CostModel):
    """Work proportional to the token count: right when linear layers dominate (short sequences, big models)."""

    name: ClassVar[str] = "tokens"

    def __call__(self, seqlen: int) -> float:
        return seqlen


# Published config.json numbers of the Qwen2.5 base models (huggingface.co/Qwen/Qwen2.5-*/blob/main/config.json).
QWEN2_5_PRESETS: dict[str, dict[str, int]] = {
    "Qwen2.5-0.5B": {
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
    },
    "Qwen2.5-1.5B": {
        "num_hidden_layers": 28,
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
    },
    "Qwen2.5-7B": {
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    },
}


@dataclass(frozen=True)
class FlopsCost(CostModel):
    """Training FLOPs of one sequence through a dense decoder-only transformer with a SwiGLU MLP.

    Per token, every weight matrix costs 2 FLOPs per parameter (q/k/v/o projections, the three MLP
    matrices and the LM head; embeddings and norms are negligible). Causal attention adds QK^T and
    PV over the lower triangle, 2 * layers * heads * head_dim * s^2 FLOPs per sequence, which is what
    makes long sequences expensive. Backward costs twice the forward, hence the factor 3; activation
    recomputation would scale every sequence by the same 4/3 and so does not change any balance.
    """

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None

    name: ClassVar[str] = "flops"

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"FlopsCost.{f.name} must be >= 1, got {getattr(self, f.name)}")

    @classmethod
    def from_config(cls, config: str | Mapping[str, Any] | Any) -> FlopsCost:
        """From a preset name (see QWEN2_5_PRESETS), a dict with HF key names, or a transformers PretrainedConfig."""
        if isinstance(config, str):
            if config not in QWEN2_5_PRESETS:
                raise ValueError(f"unknown model preset '{config}'; expected one of {', '.join(QWEN2_5_PRESETS)}")
            config = QWEN2_5_PRESETS[config]
        elif hasattr(config, "to_dict"):
            config = config.to_dict()
        elif not isinstance(config, Mapping):
            raise ValueError(f"model config must be a preset name, a dict or a PretrainedConfig, got {config!r}")
        keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in keys if config.get(k) is None]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
        return cls(
            **{k: int(config[k]) for k in keys},
            # Multi-head attention configs leave these out: one kv head per head, head_dim = hidden / heads.
            num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            head_dim=config.get("head_dim"),
        )

    @property
    def linear_flops_per_token(self) -> int:
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size
        return 2 * (self.num_hidden_layers * layer + h * self.vocab_size)

    @property
    def attention_flops_per_seqlen_squared(self) -> int:
        return 2 * self.num_hidden_layers * self.num_attention_heads * self.head_dim

    def __call__(self, seqlen: int) -> float:
        return 3 * (self.linear_flops_per_token * seqlen + self.attention_flops_per_seqlen_squared * seqlen * seqlen)


@dataclass(frozen=True)
class FitCost(CostModel):
    """a * s^2 + b * s, with coefficients fitted to step times measured on the target GPU and model."""

    a: float
    b: float

    name: ClassVar[str] = "fit"

    def __post_init__(self):
        if self.a < 0 or self.b < 0 or self.a + self.b == 0:
            raise ValueError(f"FitCost needs a >= 0 and b >= 0, not both 0; got a={self.a}, b={self.b}")

    def __call__(self, seqlen: int) -> float:
        return self.a * seqlen * seqlen + self.b * seqlen


COST_MODELS = {m.name: m for m in (TokenCost, FlopsCost, FitCost)}


def get_cost_model(cost: str | CostModel = "tokens", **kwargs: Any) -> CostModel:
    """A cost model from its name: "tokens"; "flops" (model=preset name, dict or PretrainedConfig, default
    Qwen2.5-7B); "fit" (a=..., b=...). A CostModel instance is returned as is."""
    if isinstance(cost, CostModel):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with an already built cost model {cost}")
        return cost
    if cost not in COST_MODELS:
        raise ValueError(f"unknown cost model {cost!r}; expected a CostModel or one of {', '.join(COST_MODELS)}")
    try:
        if cost == "flops":
            return FlopsCost.from_config(kwargs.pop("model", "Qwen2.5-7B"), **kwargs)
        return COST_MODELS[cost](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for the {cost!r} cost model: {e}") from None
