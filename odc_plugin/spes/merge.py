"""The expert-merging warm-up: early in training, pull every expert towards its most similar peers.

A node trains only its own experts, so an expert is improved by one node's data only. Merging mixes a
little of the similar experts into each one, which is how knowledge reaches experts across nodes. As in
the reference: on sync steps that are multiples of `merge_interval`, with strength
alpha = alpha_start * (1 - min(step / decay_steps, 1)); an expert's donors are the `topk` other experts
of its layer whose gate projections (the first projection) have the highest cosine similarity to its
own; new = own + alpha * mean over donors of (donor - own), over all the expert's matrices, with
every donor read before any expert is changed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .config import SPESConfig
from .experts import MoELayer, local_tensor


def merge_alpha(step: int, config: SPESConfig) -> float:
    """Merging strength after optimizer step `step` (0: no merge at this step)."""
    if not config.merging or step % config.merge_interval:
        return 0.0
    return config.merge_alpha_start * (1.0 - min(step / config.merge_decay_steps, 1.0))


def check_topk(topk: int, num_experts: int) -> None:
    if topk >= num_experts:
        raise ValueError(
            f"merge_topk must be below the experts per layer ({num_experts}), since an expert is "
            f"not its own donor, got {topk}"
        )


def _local_gate(layer: MoELayer, expert: int) -> torch.Tensor:
    """This rank's rows of the expert's gate projection (of an FSDP shard: the gate rows in it)."""
    weight = layer.expert_params(expert)[0]
    local = local_tensor(weight)
    offset = _first_row(weight) if isinstance(weight, DTensor) else 0
    keep = min(max(layer.gate_rows - offset, 0), local.shape[0])
    return local[:keep].reshape(-1)


def _first_row(weight: DTensor) -> int:
    """The global row where this rank's shard of a row-sharded DTensor starts (FSDP2 shards dim 0 over one
    mesh dimension and replicates over any other), by torch.chunk's rule: ceil(rows / n) rows per rank."""
    dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
    if (
        len(dims) != 1
        or weight.placements[dims[0]].dim != 0
        or not all(isinstance(p, (Shard, Replicate)) for p in weight.placements)
    ):
        raise ValueError(f"SPES merges experts sharded by rows over one mesh dimension, got {weight.placements}")
    size, rank = weight.device_mesh.size(dims[0]), weight.device_mesh.get_local_rank(dims[0])
    return min(rank * -(-weight.shape[0] // size), weight.shape[0])


def donors(layer: MoELayer, topk: int, node_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(experts, topk) indices of each expert's donors. With sharded experts every rank holds part of
    each gate projection: the dot products are summed over the node's ranks (one small all-reduce)."""
    gates = torch.stack([_local_gate(layer, e) for e in range(layer.num_experts)]).float()
    gram = gates @ gates.T
    if node_group is not None:
        dist.all_reduce(gram, group=node_group)
    sq = gram.diagonal()
    # torch's cosine_similarity, as the reference computes it, from the summed dot products
    cos = gram / (sq[:, None] * sq[None, :]).clamp_min(1e-16).sqrt()
    cos.fill_diagonal_(float("-inf"))
    return cos.topk(topk, dim=1).indices


@torch.no_grad()
def merge_experts(layers: list[MoELayer], alpha: float, topk: int, node_group: dist.ProcessGroup | None = None) -> None:
    """Merge every layer's experts in place (each rank its own shards)."""
    for layer in layers:
        check_topk(topk, layer.num_experts)
        chosen = donors(layer, topk, node_group).tolist()
        current = [[local_tensor(p) for p in layer.expert_params(e)] for e in range(layer.num_experts)]
        before = [[t.clone() for t in tensors] for tensors in current]
        for e, tensors in enumerate(current):
            for w, t in enumerate(tensors):
                own = before[e][w]
                task = torch.stack([before[d][w] - own for d in chosen[e]]).mean(0)
                t.copy_(own + alpha * task)
