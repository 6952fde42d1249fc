"""Experts as separately trainable tensors: split, assign to nodes, freeze.

transformers' MoE blocks (OLMoE, Qwen2-MoE, ...) keep all experts of a layer in two 3D parameters,
`gate_up_proj` (experts, 2 * intermediate, hidden) and `down_proj` (experts, hidden, intermediate).
Autograd and optimizers work per tensor, so part of a tensor cannot be frozen: `split_experts` gives
every expert its own parameters, which the experts' eager loop reads one expert at a time anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import SPESConfig

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class MoELayer:
    """One experts module after `split_experts`."""

    name: str
    module: nn.Module

    @property
    def num_experts(self) -> int:
        return len(self.module.gate_up_proj)

    @property
    def gate_rows(self) -> int:
        """Rows of `gate_up_proj[e]` that are the gate (the first projection); the rest are `up`."""
        return self.module.intermediate_dim

    def expert_params(self, expert: int) -> list[nn.Parameter]:
        return [getattr(self.module, w)[expert] for w in EXPERT_WEIGHTS]


def _is_fused_experts(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, w, None), nn.Parameter) and getattr(module, w).dim() == 3 for w in EXPERT_WEIGHTS
    )


def split_experts(model: nn.Module) -> nn.Module:
    """Replace every fused experts module's 3D weights by one parameter per expert (same values).

    Call before sharding. Switches the model to the eager experts loop, the one that indexes weights
    per expert (the batched implementations need the 3D tensors).
    """
    found = False
    for module in model.modules():
        if not _is_fused_experts(module):
            continue
        found = True
        for w in EXPERT_WEIGHTS:
            fused = getattr(module, w)
            delattr(module, w)
            setattr(
                module,
                w,
                nn.ParameterList(
                    nn.Parameter(fused[e].detach().clone(), fused.requires_grad) for e in range(fused.shape[0])
                ),
            )
    if not found:
        raise ValueError(
            "split_experts found no MoE experts module with 3D gate_up_proj and down_proj "
            "parameters (transformers' OLMoE / Qwen2-MoE layout)"
        )
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", "eager") != "eager":
        model.set_experts_implementation("eager")
    return model


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The experts modules of a model that went through `split_experts`, in module order."""
    layers = [
        MoELayer(name, m)
        for name, m in model.named_modules()
        if all(isinstance(getattr(m, w, None), nn.ParameterList) for w in EXPERT_WEIGHTS)
    ]
    if not layers:
        raise ValueError("no split experts found: call split_experts(model) first")
    if len({layer.num_experts for layer in layers}) > 1:
        raise ValueError("every MoE layer must have the same number of experts")
    return layers


def assign_experts(num_experts: int, num_nodes: int, node: int) -> range:
    """The experts `node` trains: [node * k, (node + 1) * k) with k = num_experts / num_nodes."""
    if num_nodes < 1 or not 0 <= node < num_nodes:
        raise ValueError(f"node must be in [0, {num_nodes}), got {node}")
    if num_experts % num_nodes:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the number of nodes ({num_nodes}): "
            f"SPES gives every node the same number of experts"
        )
    k = num_experts // num_nodes
    return range(node * k, (node + 1) * k)


def freeze_experts(model: nn.Module, owned: range) -> None:
    """Freeze every expert outside `owned` in every MoE layer: it then gets no gradient, and an optimizer
    built over `trainable_parameters(model)` holds no state for it. Call before sharding."""
    for layer in moe_layers(model):
        if owned.start < 0 or owned.stop > layer.num_experts:
            raise ValueError(f"owned experts {owned} outside the layer's {layer.num_experts} experts")
        for e in range(layer.num_experts):
            for p in layer.expert_params(e):
                p.requires_grad_(e in owned)


def prepare_experts(model: nn.Module, config: SPESConfig, num_nodes: int, node: int) -> range:
    """Split the experts and, in `spes` mode, freeze all but this node's; returns the experts it trains.
    Call before sharding."""
    split_experts(model)
    num_experts = moe_layers(model)[0].num_experts
    owned = assign_experts(num_experts, num_nodes, node) if config.mode == "spes" else range(num_experts)
    freeze_experts(model, owned)
    return owned


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: the shard of an FSDP2 DTensor, else the tensor."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach()
