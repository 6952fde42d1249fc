"""Cost of training on one sequence, as a function of its length.

Balancing only needs costs that are proportional to the time a rank spends on a sequence, so each model
answers "how much work is a sequence of length s" in its own unit (tokens, FLOPs, or whatever unit the
calibration measured).

The `flops` cost is verl's own count (`VerlFlopsCost`, the formulas of verl's FlopsCounter) wherever verl
knows the model's architecture, and this module's `FlopsCost` otherwise. The package stays free of verl at
import: this module imports it in `verl_flops_formula`, when a cost is built.
"""

from __future__ import annotations

import copy
import json
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
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
# Published config.json numbers of dense Qwen3 models (huggingface.co/Qwen/Qwen3-8B/blob/main/config.json).
QWEN3_PRESETS: dict[str, dict[str, int]] = {
    "Qwen3-8B": {
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
    },
}
PRESETS = {**QWEN2_5_PRESETS, **QWEN3_PRESETS, **MOE_PRESETS}
# Each preset's config.json model_type: which of verl's FlopsCounter formulas counts it.
PRESET_MODEL_TYPES = {
    **dict.fromkeys(QWEN2_5_PRESETS, "qwen2"),
    **dict.fromkeys(QWEN3_PRESETS, "qwen3"),
    **dict.fromkeys(MOE_PRESETS, "qwen3_moe"),
}


@dataclass(frozen=True)
class FlopsCost(CostModel):
    """Training FLOPs of one sequence through a decoder-only transformer with SwiGLU MLPs, dense or
    mixture-of-experts: the fallback of the `flops` cost for a model whose architecture verl's FlopsCounter
    does not know (`flops_cost`).

    Per token, every weight matrix the token passes through costs 2 FLOPs per parameter (q/k/v/o
    projections, the three MLP matrices and the LM head; norms are negligible); the input embedding, a
    lookup, is counted like the head as verl's FlopsCounter counts it, so that on a dense model both counts
    agree. In an MoE layer a token passes through its `num_experts_per_tok` experts (and a shared expert,
    if any) and the router, not through all experts: the active parameters, not the total, set the cost.
    Causal attention adds QK^T and PV over the lower triangle, 2 * layers * heads * head_dim * s^2 FLOPs
    per sequence, which is what makes long sequences expensive. Backward costs twice the forward, hence the
    factor 3; activation recomputation would scale every sequence by the same 4/3 and so does not change
    any balance.
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
        per_token = self.linear_flops_per_token + 2 * self.hidden_size * self.vocab_size  # + the input embedding
        return 3 * (per_token * seqlen + self.attention_flops_per_seqlen_squared * seqlen * seqlen)


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


def model_config(model: str | Path | Mapping[str, Any] | Any) -> Mapping[str, Any] | Any:
    """A model's config for the `flops` cost: a preset name (PRESETS, with its model_type), a directory
    holding a Hugging Face config.json (or that file), a dict with HF key names, or a PretrainedConfig.

    A config.json is read with transformers' AutoConfig (which fills each architecture's defaults, as the
    trainer's config has them); one whose model_type transformers does not know stays a dict."""
    if isinstance(model, str) and model in PRESETS:
        return {**PRESETS[model], "model_type": PRESET_MODEL_TYPES[model]}
    if not isinstance(model, (str, Path)):
        if not (isinstance(model, Mapping) or hasattr(model, "to_dict")):
            raise ValueError(f"model config must be a preset name, a dict or a PretrainedConfig, got {model!r}")
        return model
    path = Path(model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if path.name != "config.json" or not path.is_file():
        raise ValueError(
            f"model {str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor a directory holding a config.json"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent))
    except (ValueError, KeyError):  # a model_type this transformers does not know
        return config


def verl_flops_formula(model_type: str | None) -> Callable[..., float] | None:
    """verl's FlopsCounter formula for a config.json model_type, None where verl has none.

    verl is imported here when a cost is built (as lb_micro imports it when it splits) so that the package
    (the planner, LB-Mini, the demo) imports without it. FlopsCounter keeps one formula per model_type in
    `ESTIMATE_FUNC` and calls it as (config, tokens, sequence lengths, seconds) -> TFLOP/s; its own
    `estimate_flops` also asks the device for its peak FLOP/s, which raises in a process without an
    accelerator (the trainer's driver, odc-plan on a laptop), so the formula is called directly. Without
    verl (the GPU check machine runs the benchmarks from the tree alone) the project's own formula serves.
    """
    try:
        from verl.utils.flops_counter import ESTIMATE_FUNC
    except ImportError:
        return None

    return ESTIMATE_FUNC.get(model_type)


def _attribute_config(config: Mapping[str, Any] | Any) -> Any:
    """The config as verl's formulas read it, by attribute: a dict (a preset) becomes its transformers
    config class, which fills the architecture's defaults."""
    if not isinstance(config, Mapping):
        return config
    from transformers import AutoConfig

    options = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **options)


@dataclass(frozen=True)
class VerlFlopsCost(CostModel):
    """Training FLOPs of one sequence as verl's FlopsCounter counts them for its MFU metric, from the
    model's Hugging Face config: every architecture verl knows (about 20 model types: dense, sliding-window
    and hybrid attention, mixture of experts, multi-head latent attention).

    verl's count is a sum over the sequences of a batch, so one sequence's cost is its count alone; each
    length is counted once and remembered (a plan costs the same lengths many times).
    """

    config: Any  # a transformers PretrainedConfig whose model_type verl_flops_formula knows
    _by_length: dict[int, float] = field(default_factory=dict, compare=False, repr=False)

    name: ClassVar[str] = "flops"

    def __post_init__(self):
        if verl_flops_formula(self.model_type) is None:
            raise ValueError(f"verl's FlopsCounter has no formula for model_type {self.model_type!r}")

    @property
    def model_type(self) -> str | None:
        return getattr(self.config, "model_type", None)

    @property
    def num_hidden_layers(self) -> int:
        text = getattr(self.config, "text_config", None) or self.config  # multimodal configs nest the LM's
        return int(text.num_hidden_layers)

    def __call__(self, seqlen: int) -> float:
        cost = self._by_length.get(seqlen)
        if cost is None:
            formula = verl_flops_formula(self.model_type)
            cost = self._by_length[seqlen] = formula(self.config, seqlen, [seqlen], 1.0) * 1e12  # TFLOP in 1 s
        return cost

    def dense(self) -> VerlFlopsCost:
        """The same model costed as if every token passed through every expert: the total parameters."""
        experts = next(
            (
                getattr(self.config, k)
                for k in ("num_experts", "num_local_experts", "n_routed_experts")
                if getattr(self.config, k, None)
            ),
            None,
        )
        if not experts:
            return self
        config = copy.deepcopy(self.config)
        config.num_experts_per_tok = experts
        return VerlFlopsCost(config)


def flops_cost(model: str | Path | Mapping[str, Any] | Any = "Qwen2.5-7B") -> CostModel:
    """The `flops` cost of a model (anything `model_config` takes): verl's FlopsCounter count where verl
    knows the architecture (its model_type), FlopsCost's own formula otherwise."""
    config = model_config(model)
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    if verl_flops_formula(model_type) is not None:
        return VerlFlopsCost(_attribute_config(config))
    return FlopsCost.from_config(config)


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
    """A cost model from its name: "tokens"; "flops" (model=preset name, config.json directory, dict or
    PretrainedConfig, default Qwen2.5-7B; see flops_cost); "fit" (a=..., b=..., or file=a CostCalibration
    JSON). A CostModel instance is returned as is."""
    if isinstance(cost, CostModel):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with an already built cost model {cost}")
        return cost
    if cost not in COST_MODELS:
        raise ValueError(f"unknown cost model {cost!r}; expected a CostModel or one of {', '.join(COST_MODELS)}")
    try:
        if cost == "flops":
            return flops_cost(kwargs.pop("model", "Qwen2.5-7B"), **kwargs)
        if cost == "fit" and "file" in kwargs:
            return FitCost.from_file(kwargs.pop("file"), **kwargs)
        return COST_MODELS[cost](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for the {cost!r} cost model: {e}") from None
