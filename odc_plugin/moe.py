"""Where a rank's tokens go in a mixture-of-experts model: tokens per expert per MoE layer, counted by
hooks on the routers, and what the counts of all ranks say about routing imbalance.

A router is recognised by what it is, not by its class: a module with `num_experts` and `top_k` that
returns the chosen experts' indices last (transformers 5's Qwen2/Qwen3-MoE `TopKRouter` and its kin).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _is_router(module: nn.Module) -> bool:
    return isinstance(getattr(module, "num_experts", None), int) and isinstance(getattr(module, "top_k", None), int)


class ExpertRouting:
    """Tokens routed to each expert of each MoE layer by this process's forward passes since `take()`."""

    def __init__(self, model: nn.Module):
        routers = [module for module in model.modules() if _is_router(module)]
        experts = max((router.num_experts for router in routers), default=0)
        self.counts = torch.zeros(len(routers), experts, dtype=torch.int64)
        self._hooks = [router.register_forward_hook(self._counter(layer)) for layer, router in enumerate(routers)]

    @classmethod
    def of(cls, model: nn.Module) -> ExpertRouting | None:
        """A counter for `model`, or None for a model without routers."""
        return cls(model) if any(_is_router(m) for m in model.modules()) else None

    def _counter(self, layer: int):
        def count(module, args, output):
            indices = (output[-1] if isinstance(output, tuple) else output).detach().reshape(-1)
            if self.counts.device != indices.device:
                self.counts = self.counts.to(indices.device)
            # index_add_, not bincount: bincount reads the largest index back, a GPU sync in every layer
            self.counts[layer].index_add_(0, indices, torch.ones_like(indices))

        return count

    def take(self) -> torch.Tensor:
        """[layers, experts] counts so far (on CPU), and a fresh start."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts.cpu()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def routing_metrics(counts: list[torch.Tensor]) -> dict[str, float]:
    """From each rank's [layers, experts] token counts of one mini-batch:

    - `expert_load_max_<r>`: rank r's busiest expert over the mean expert load of its layer, worst layer
      (1: tokens spread evenly; the number of experts: all to one);
    - `idle_experts_<r>`: (layer, expert) pairs that got none of rank r's tokens;
    - `routing_divergence`: how far a rank's routing is from all ranks' together (total variation of the
      per-layer expert shares, mean over layers, the most different rank): 0 when every rank routes alike.
    """
    every = torch.stack(counts).double()  # [ranks, layers, experts]
    values = {}
    for rank, mine in enumerate(every):
        mean = mine.mean(-1).clamp_min(1e-12)
        values[f"expert_load_max_{rank}"] = (mine.max(-1).values / mean).max().item()
        values[f"idle_experts_{rank}"] = float((mine == 0).sum())
    shares = every / every.sum(-1, keepdim=True).clamp_min(1)
    together = every.sum(0) / every.sum((0, 2))[:, None].clamp_min(1)
    values["routing_divergence"] = (0.5 * (shares - together).abs().sum(-1)).mean(-1).max().item()
    return values
