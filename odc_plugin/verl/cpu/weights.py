"""The trainer's weights in the rollout model's own layout.

verl sends weights the way vLLM loads checkpoints: an MoE layer's experts one by one
(`...mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`), and, for a LoRA run's base sync, the
adapted layers' base weights under `...<layer>.base_layer.weight`. The model the `hf` rollout builds
is whatever the installed transformers makes of the checkpoint: transformers 5 fuses an MoE layer's
experts into two 3-D tensors (`experts.gate_up_proj` [E, 2I, H], gate rows first, and `experts.down_proj`
[E, H, I]); a LoRA-wrapped model names its base weights `base_layer`. `to_model_layout` maps what was sent
onto what the model has, by name and shape, and names what still does not fit.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from . import ROLLOUT_NAME

_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# A PEFT-wrapped model's names: "base_model.model." in front, ".base_layer" inside an adapted layer.
_PEFT_PREFIX, _BASE_LAYER = "base_model.model.", ".base_layer"


def plain_name(name: str) -> str:
    """A weight's name as the unwrapped model calls it."""
    return name.removeprefix(_PEFT_PREFIX).replace(_BASE_LAYER, "")


def to_model_layout(sent: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sent` renamed and reshaped to the names and shapes of `own` (a model's state dict).

    Raises KeyError for a sent weight the model has no place for, ValueError for a shape that does not fit.
    """
    own_by_plain = {plain_name(name): name for name in own}
    state, experts = {}, defaultdict(dict)
    for name, tensor in sent.items():
        name = plain_name(name)
        match = _PER_EXPERT.match(name)
        if match and name not in own_by_plain:
            experts[match["experts"]][(int(match["expert"]), match["proj"])] = tensor
        else:
            state[name] = tensor
    for prefix, parts in experts.items():
        state.update(_fused_experts(prefix, parts))

    unknown = sorted(name for name in state if name not in own_by_plain)
    if unknown:
        raise KeyError(
            f"rollout '{ROLLOUT_NAME}': the trainer sent weights the rollout model does not have: {unknown[:5]}"
        )
    out = {}
    for name, tensor in state.items():
        target = own_by_plain[name]
        out[target] = _fit_shape(name, tensor, own[target].shape)
    return out


def _fused_experts(prefix: str, parts: dict[tuple[int, str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One MoE layer's experts, sent one by one, as the two stacked tensors transformers 5 holds."""
    count = 1 + max(expert for expert, _ in parts)
    missing = [
        f"{prefix}.{e}.{proj}.weight"
        for e in range(count)
        for proj in ("gate_proj", "up_proj", "down_proj")
        if (e, proj) not in parts
    ]
    if missing:
        raise KeyError(f"rollout '{ROLLOUT_NAME}': the trainer sent part of {prefix}'s experts; missing {missing[:5]}")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        shapes = {e: list(parts[(e, proj)].shape) for e in range(count)}
        odd = [e for e in range(count) if shapes[e] != shapes[0]]
        if odd:
            raise ValueError(
                f"rollout '{ROLLOUT_NAME}': the trainer sent {prefix}.{odd[0]}.{proj}.weight with shape "
                f"{shapes[odd[0]]}, expert 0's is {shapes[0]}"
            )
    gate_up = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(count)])
    down = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}


def _fit_shape(name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if tensor.shape == shape:
        return tensor
    # some models keep stacked experts as [E, in, out] (the transpose of the per-expert Linear weights)
    if tensor.dim() == 3 and tensor.shape[0] == shape[0] and tensor.transpose(1, 2).shape == shape:
        return tensor.transpose(1, 2).contiguous()
    raise ValueError(
        f"rollout '{ROLLOUT_NAME}': the trainer sent {name} with shape {list(tensor.shape)}, the rollout "
        f"model holds it as {list(shape)}"
    )
