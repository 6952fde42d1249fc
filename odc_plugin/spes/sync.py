"""What crosses between nodes, and when: SPES's sync and the two baselines' communication.

Every `sync_every` steps (`spes`): the shared parameters are averaged with one all-reduce, and each
node receives, with one all-to-all, the experts it lacks straight from their owners; a node sends its
own experts only. `fedavg` averages the whole model with one all-reduce on the same steps;
`centralized` all-reduces the gradients before every optimizer step. Each rank works on its own shard
(see layout.py), so with several ranks per node a node's traffic is the sum over its ranks.

Bytes are counted per rank from the buffers handed to the collectives: an all-reduce of B bytes over N
nodes sends and receives 2 (N - 1) / N * B per node (a ring: reduce-scatter, then all-gather, which is
what gloo's allreduce and NCCL's for large buffers do); the all-to-all sends this node's experts to the
N - 1 other nodes and receives theirs.

With an outer optimizer (outer.py) each node steps what it trains after the average and before the
exchange, so what the exchange sends is already stepped and moves the same bytes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .config import SPESConfig
from .experts import assign_experts, local_tensor, moe_layers, trainable_parameters
from .layout import NodeLayout
from .merge import check_topk, merge_alpha, merge_experts
from .outer import OuterOptimizer, unflatten


class SPESSyncError(RuntimeError):
    """A sync across nodes failed: a peer died, or did not arrive within the timeout."""


@dataclass
class CommRecord:
    step: int
    kind: str  # "sync" (spes, fedavg) or "grads" (centralized)
    sent: int  # bytes this rank sent
    received: int
    seconds: float
    merge_alpha: float = 0.0


def allreduce_bytes(nbytes: int, nodes: int) -> int:
    return 2 * (nodes - 1) * nbytes // nodes


class NodeSync:
    """The cross-node side of one rank. Build it after `prepare_experts` (experts split and, in `spes`
    mode, the other nodes' frozen) and after sharding."""

    def __init__(self, model: nn.Module, layout: NodeLayout, config: SPESConfig):
        self.model, self.layout, self.config = model, layout, config
        self._reshard()
        self.layers = moe_layers(model)
        self.num_experts = self.layers[0].num_experts
        self.records: list[CommRecord] = []
        nodes = layout.num_nodes
        if config.mode == "spes":
            self.owned = assign_experts(self.num_experts, nodes, layout.node)
            # every node's experts, in one order that all nodes share
            self.experts_of = [
                [
                    p
                    for layer in self.layers
                    for e in assign_experts(self.num_experts, nodes, q)
                    for p in layer.expert_params(e)
                ]
                for q in range(nodes)
            ]
            for q, params in enumerate(self.experts_of):
                if q != layout.node and any(p.requires_grad for p in params):
                    raise ValueError(
                        f"node {layout.node} trains experts of node {q}: call prepare_experts before sharding"
                    )
            expert_ids = {id(p) for params in self.experts_of for p in params}
            self.shared = [p for p in model.parameters() if id(p) not in expert_ids]
            if config.merging:
                check_topk(config.merge_topk, self.num_experts)
        else:
            self.owned = range(self.num_experts)
            self.experts_of = []
            self.shared = list(model.parameters())
        # anchored at the weights every node starts from
        self.outer = OuterOptimizer(trainable_parameters(model), config) if config.outer else None

    @torch.no_grad()
    def reduce_gradients(self, step: int) -> CommRecord | None:
        """Centralized mode: average the gradients over nodes (call after backward, before the step)."""
        if self.config.mode != "centralized":
            return None
        start = time.perf_counter()
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # no token reached it on this node; others may have grads for it
                p.grad = torch.zeros_like(p)
        grads = [local_tensor(p.grad) for p in params]
        with self._failures(step, "gradient all-reduce"):
            moved = self._average(grads)
        return self._record(step, "grads", moved, moved, start)

    def maybe_sync(self, step: int) -> CommRecord | None:
        """Call after optimizer step `step` (counting from 1): syncs on multiples of `sync_every`."""
        if self.config.mode == "centralized" or step % self.config.sync_every:
            return None
        return self.sync(step)

    @torch.no_grad()
    def sync(self, step: int) -> CommRecord:
        start = time.perf_counter()
        self._reshard()
        with self._failures(step, "shared-parameter average"):
            sent = received = self.average_shared()
        if self.outer:
            self.outer.step()
        with self._failures(step, "expert exchange"):
            s, r = self.exchange_experts()
        alpha = merge_alpha(step, self.config)
        if alpha > 0:
            with self._failures(step, "expert merge"):
                merge_experts(self.layers, alpha, self.config.merge_topk, self.layout.node_group)
        if self.outer:
            self.outer.reset_anchor()
        return self._record(step, "sync", sent + s, received + r, start, alpha)

    @torch.no_grad()
    def average_shared(self) -> int:
        """Average the shared parameters (in fedavg: all of them) over nodes; returns bytes sent."""
        return self._average([local_tensor(p) for p in self.shared])

    @torch.no_grad()
    def exchange_experts(self) -> tuple[int, int]:
        """Overwrite every expert this node does not own with its owner's copy; (bytes sent, received)."""
        if not self.experts_of:
            return 0, 0
        nodes, node = self.layout.num_nodes, self.layout.node
        own = torch.cat([local_tensor(p).reshape(-1) for p in self.experts_of[node]])
        # Equal splits: every node owns as many experts, of the same shapes, sharded the same way. The
        # chunk to itself stays in memory.
        out = torch.empty(nodes * own.numel(), dtype=own.dtype, device=own.device)
        dist.all_to_all_single(out, own.repeat(nodes), group=self.layout.cross_group)
        for q, chunk in enumerate(out.split(own.numel())):
            if q != node:
                unflatten(chunk, [local_tensor(p) for p in self.experts_of[q]])
        moved = (nodes - 1) * own.numel() * own.element_size()
        return moved, moved

    def total_bytes(self) -> tuple[int, int]:
        return sum(r.sent for r in self.records), sum(r.received for r in self.records)

    def _reshard(self) -> None:
        # An FSDP root keeps its parameters gathered after a forward without backward (an evaluation),
        # and the model then shows those copies instead of the shards: the sync must read and write
        # the shards, and the next forward must gather them anew.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _average(self, tensors: list[torch.Tensor]) -> int:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.layout.cross_group)
        flat /= self.layout.num_nodes
        unflatten(flat, tensors)
        return allreduce_bytes(flat.numel() * flat.element_size(), self.layout.num_nodes)

    def _record(self, step, kind, sent, received, start, alpha=0.0) -> CommRecord:
        record = CommRecord(step, kind, sent, received, time.perf_counter() - start, alpha)
        self.records.append(record)
        return record

    @contextlib.contextmanager
    def _failures(self, step: int, phase: str):
        try:
            yield
        except RuntimeError as e:  # gloo raises plain RuntimeErrors for a dead or late peer
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise SPESSyncError(
                f"node {self.layout.node} (local rank {self.layout.local_rank}): {self.config.mode} sync at step "
                f"{step} failed in the {phase} (sync timeout {self.config.sync_timeout_s:g}s): {detail}"
            ) from None
