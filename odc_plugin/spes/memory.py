"""Per-rank training state: what it should be (counted) and what is actually held (measured)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .experts import local_tensor
from .outer import OuterOptimizer


@dataclass(frozen=True)
class StateBytes:
    counted: int  # trainable elements x (param + grad + Adam's two moments), at the parameters' dtype
    measured: int  # bytes of the distinct tensors held: trainable params, their grads, optimizer state
    frozen: int  # bytes of the weights held but not trained (SPES: the other nodes' experts)
    outer: int  # bytes of the outer optimizer's state: the weights at the last sync and their momentum


def _storage_bytes(tensors) -> int:
    # A tensor's own bytes, once per address: ODC's gradients are views of one accumulator region, whose
    # alignment padding is ODC's overhead (OnDemandComm.memory_bytes), not this rank's training state.
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, outer: OuterOptimizer | None = None) -> StateBytes:
    """This rank's state, after at least one optimizer step (before it, Adam holds no moments)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [local_tensor(p) for p in model.parameters() if not p.requires_grad]
    counted = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in trainable) * 4
    held = [local_tensor(p) for p in trainable]
    held += [local_tensor(p.grad) for p in trainable if p.grad is not None]
    held += [local_tensor(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return StateBytes(counted, _storage_bytes(held), _storage_bytes(frozen), outer.state_bytes() if outer else 0)
