"""The outer optimizer: a step along the change a sync agreed on, with momentum across syncs.

Between syncs each node's copy drifts with its own batches, and a plain average of the copies keeps
only the mean of that drift. DiLoCo (arXiv 2311.08105) takes the weights at the last sync minus the
synced weights as a gradient (the pseudo-gradient) and steps the weights at the last sync along it with
Nesterov momentum (its published settings: lr 0.7, momentum 0.9): the momentum carries the direction
the nodes agreed on over several syncs.

Each node steps only what it trains: the shared parameters once averaged, and its own experts, which
are the synced value of those experts since their owner alone trains them. The other nodes' experts
then arrive already stepped by their owner, and the outer state, like AdamW's, is held for the trained
parameters only. The step is elementwise, so nodes holding the same synced values and the same history
get the same result.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import SPESConfig
from .experts import local_tensor


def flatten(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([local_tensor(p).reshape(-1) for p in params])


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


class OuterOptimizer:
    """torch.optim.SGD over one flat copy of this rank's trained parameters as of the last sync (the
    anchor), whose gradient is the anchor minus the synced parameters."""

    def __init__(self, params: list[nn.Parameter], config: SPESConfig):
        self.params = params
        self.anchor = flatten(params)
        momentum = config.outer_momentum
        self.optimizer = torch.optim.SGD([self.anchor], lr=config.outer_lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def step(self) -> None:
        """Replace the synced parameters by the outer step from the anchor, which moves there too."""
        self.anchor.grad = self.anchor - flatten(self.params)
        self.optimizer.step()
        unflatten(self.anchor, [local_tensor(p) for p in self.params])

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Anchor the next sync at the parameters as this one left them (after merging)."""
        self.anchor.copy_(flatten(self.params))

    def state_bytes(self) -> int:
        """The anchor and, from the first step on, its momentum."""
        copies = 2 if self.optimizer.defaults["momentum"] > 0 else 1
        return copies * self.anchor.numel() * self.anchor.element_size()
