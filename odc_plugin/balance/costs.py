"""Cost of training on one sequence, as a function of its length.

Balancing only needs costs that are proportional to the time a rank spends on a sequence, so each model
answers "how much work is a sequence of length s" in its own unit (tokens, FLOPs, or whatever unit the
calibration measured).
"""

from __future__ import annotations

import json
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np


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


# Published config.json numbers of MoE models (huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json).
MOE_PRESETS: dict[str, dict[str, int]] = {
    "Qwen3-30B-A3B": {
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
    },
}
PRESETS = {**QWEN2_5_PRESETS, **MOE_PRESETS}


@dataclass(frozen=True)
class FlopsCost(CostModel):
    """Training FLOPs of one sequence through a decoder-only transformer with SwiGLU MLPs, dense or
    mixture-of-experts.

    Per token, every weight matrix the token passes through costs 2 FLOPs per parameter (q/k/v/o
    projections, the three MLP matrices and the LM head; embeddings and norms are negligible). In an MoE
    layer a token passes through its `num_experts_per_tok` experts (and a shared expert, if any) and the
    router, not through all experts: the active parameters, not the total, set the cost. Causal attention
    adds QK^T and PV over the lower triangle, 2 * layers * heads * head_dim * s^2 FLOPs per sequence,
    which is what makes long sequences expensive. Backward costs twice the forward, hence the factor 3;
    activation recomputation would scale every sequence by the same 4/3 and so does not change any balance.
    """

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    # Mixture of experts (all 0: a dense model). intermediate_size is then the dense layers' MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: int = 0  # layers whose MLP is a mixture of experts
    shared_expert_intermediate_size: int = 0  # an expert every token passes through, if the model has one

    name: ClassVar[str] = "flops"

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for f in fields(self):
            least = 0 if f.default == 0 else 1
            if getattr(self, f.name) < least:
                raise ValueError(f"FlopsCost.{f.name} must be >= {least}, got {getattr(self, f.name)}")
        if self.moe_layers > self.num_hidden_layers:
            raise ValueError(
                f"FlopsCost.moe_layers must be <= num_hidden_layers ({self.num_hidden_layers}), got {self.moe_layers}"
            )
        if self.moe_layers and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size):
            raise ValueError(
                "FlopsCost with moe_layers needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size >= 1"
            )

    @classmethod
    def from_config(cls, config: str | Mapping[str, Any] | Any) -> FlopsCost:
        """From a preset name (see QWEN2_5_PRESETS), a dict with HF key names, or a transformers PretrainedConfig."""
        if isinstance(config, str):
            if config not in PRESETS:
                raise ValueError(f"unknown model preset '{config}'; expected one of {', '.join(PRESETS)}")
            config = PRESETS[config]
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
            **_moe_fields(config),
        )

    def dense(self) -> FlopsCost:
        """The same model costed as if every token passed through every expert: the total parameters."""
        return replace(self, num_experts_per_tok=self.num_experts) if self.moe_layers else self

    @property
    def linear_flops_per_token(self) -> int:
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = 2 * h * q + 2 * h * kv
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = (
            3 * h * (self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size)
            + h * self.num_experts
        )  # the router
        layers = (
            self.num_hidden_layers * attention
            + (self.num_hidden_layers - self.moe_layers) * dense_mlp
            + self.moe_layers * moe_mlp
        )
        return 2 * (layers + h * self.vocab_size)

    @property
    def attention_flops_per_seqlen_squared(self) -> int:
        return 2 * self.num_hidden_layers * self.num_attention_heads * self.head_dim

    def __call__(self, seqlen: int) -> float:
        return 3 * (self.linear_flops_per_token * seqlen + self.attention_flops_per_seqlen_squared * seqlen * seqlen)


def _moe_fields(config: Mapping[str, Any]) -> dict[str, int]:
    """FlopsCost's mixture-of-experts fields from an HF config: Qwen2/3-MoE names (num_experts,
    moe_intermediate_size, decoder_sparse_step, mlp_only_layers, shared_expert_intermediate_size) or
    Mixtral's (num_local_experts; experts as wide as intermediate_size, every layer)."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return {}
    layers, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        "moe_layers": sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
    }


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

    @classmethod
    def from_file(cls, path: str | Path) -> FitCost:
        """The per-layer fit of a CostCalibration file (benchmarks/calibrate_cost.py)."""
        calibration = CostCalibration.load(path)
        return cls(calibration.a, calibration.b)


def fit_quadratic(seqlens: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Non-negative (a, b) of t(s) = a * s^2 + b * s with the least squared relative error over the points.

    Relative, not absolute: a 32k sequence takes 64 to 4096 times as long as a 512 one, and an absolute
    fit would let the long sequences' noise decide b, the term that dominates short sequences.
    """
    s, t = np.asarray(seqlens, dtype=float), np.asarray(times, dtype=float)
    if s.ndim != 1 or s.shape != t.shape:
        raise ValueError(f"fit_quadratic needs one time per sequence length, got {len(s)} lengths and {len(t)} times")
    if (s <= 0).any() or (t <= 0).any():
        raise ValueError("fit_quadratic needs positive sequence lengths and times")
    if len(np.unique(s)) < 2:
        raise ValueError("fit_quadratic needs at least two distinct sequence lengths")
    # Dividing each row by its t turns the residual a*s^2/t + b*s/t - 1 into the relative error.
    x = np.stack([s * s, s], axis=1) / t[:, None]
    ones = np.ones_like(t)
    coef = np.linalg.lstsq(x, ones, rcond=None)[0]
    if (coef < 0).any():
        # The constrained optimum then lies on a = 0 or b = 0; either one-coefficient fit is positive
        # because x and the target are, so the better of the two is the non-negative least squares answer.
        a_only, b_only = (x[:, i].sum() / (x[:, i] @ x[:, i]) for i in range(2))
        edges = [np.array([a_only, 0.0]), np.array([0.0, b_only])]
        coef = min(edges, key=lambda c: float(np.sum((x @ c - ones) ** 2)))
    return float(coef[0]), float(coef[1])


@dataclass(frozen=True)
class CostCalibration:
    """What benchmarks/calibrate_cost.py measured: forward+backward seconds of one decoder layer of `model`
    (a QWEN2_5_PRESETS name; `layer` is the shape actually timed) on `device`, and their fit a*s^2 + b*s."""

    model: str
    device: str
    dtype: str
    a: float
    b: float
    unit: str
    points: list[list[float]]  # [seqlen, seconds], measured
    max_rel_error: float  # of the fit over the points
    layer: dict[str, int]
    # backward seconds per forward second; the fit is of their sum (odc-demo --emulate splits it so)
    backward_ratio: float = 2.0

    UNIT: ClassVar[str] = "seconds per layer"

    @property
    def num_hidden_layers(self) -> int | None:
        """The layer count of the preset this calibration is named after (None if not a preset)."""
        return QWEN2_5_PRESETS.get(self.model, {}).get("num_hidden_layers")

    def save(self, path: str | Path) -> None:
        # One key per line with compact values keeps the checked-in files short and readable in a diff.
        items = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in asdict(self).items())
        Path(path).write_text(f"{{\n{items}\n}}\n")

    @classmethod
    def load(cls, path: str | Path) -> CostCalibration:
        where = f"cost calibration {str(path)!r}"
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"{where} cannot be read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON: {e}") from None
        if not isinstance(data, dict):
            # A ValueError like every other bad file, so that callers report it the same way.
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")  # noqa: TRY004
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        for key in ("a", "b", "backward_ratio"):
            value = data.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
                raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
        if data["a"] + data["b"] == 0:
            raise ValueError(f"{where}: a and b are both 0")
        if data["unit"] != cls.UNIT:
            raise ValueError(f"{where}: unit must be {cls.UNIT!r}, got {data['unit']!r}")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


COST_MODELS = {m.name: m for m in (TokenCost, FlopsCost, FitCost)}


def get_cost_model(cost: str | CostModel = "tokens", **kwargs: Any) -> CostModel:
    """A cost model from its name: "tokens"; "flops" (model=preset name, dict or PretrainedConfig, default
    Qwen2.5-7B); "fit" (a=..., b=..., or file=a CostCalibration JSON). A CostModel instance is returned as is."""
    if isinstance(cost, CostModel):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with an already built cost model {cost}")
        return cost
    if cost not in COST_MODELS:
        raise ValueError(f"unknown cost model {cost!r}; expected a CostModel or one of {', '.join(COST_MODELS)}")
    try:
        if cost == "flops":
            return FlopsCost.from_config(kwargs.pop("model", "Qwen2.5-7B"), **kwargs)
        if cost == "fit" and "file" in kwargs:
            return FitCost.from_file(kwargs.pop("file"), **kwargs)
        return COST_MODELS[cost](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for the {cost!r} cost model: {e}") from None
