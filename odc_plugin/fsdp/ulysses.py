"""A long sample split over a block of ranks (Ulysses sequence parallelism) for one micro-batch under ODC.

LB-Mini moves whole samples, so a mini-batch lasts at least its longest sample on one rank
(odc_plugin/balance/split.py plans past that bound). Split over a group of k ranks, each member holds a
k-th of the sample's tokens, with every head; around attention, all-to-alls give each member every token
of a k-th of the heads, and back. Only the split micro-batch is a collective, among its group's members;
ODC needs nothing more: each member gathers the layers' parameters on its own and accumulates the
gradient of its slice into the owners, where the slices' sums are the sample's gradient.

The groups are the aligned blocks of k consecutive ranks, k a power of two dividing the world size, up to
`max_group`: created once (`SequenceGroups`, collective), so nothing is created per step, and a plan
picks one per split sample. The members of a block must run its split micro-batches in the same order
(a plan runs them first in the mini-batch); a rank outside the block runs none of them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SplitMember:
    """The block a micro-batch is split over, as one member sees it."""

    ranks: tuple[int, ...]
    index: int  # this rank's place in the block: which k-th of the tokens it holds
    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return len(self.ranks)

    def bounds(self, length: int) -> tuple[int, int]:
        """This member's token slice [start, stop) of a sample of `length` tokens, padded to k equal
        slices (padding goes at the end, where causal attention keeps it out of every real token)."""
        chunk = -(-length // self.size)
        return self.index * chunk, (self.index + 1) * chunk


_ACTIVE: ContextVar[SplitMember | None] = ContextVar("odc_sequence_split", default=None)


def active_split() -> SplitMember | None:
    """The split the running micro-batch is in on this rank, if any."""
    return _ACTIVE.get()


class SequenceGroups:
    """Every aligned block of k consecutive ranks, k = 2, 4, ... up to `max_group` (a power of two dividing
    the world size), each with its process group. Collective: every rank builds it, in the same order.
    `timeout_s` bounds each of the groups' collectives: a member that raised inside a split micro-batch leaves
    the others waiting in the next exchange until then (None: the default group's timeout)."""

    def __init__(self, max_group: int, timeout_s: float | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        if max_group < 1 or max_group & (max_group - 1) or world % max_group:
            raise ValueError(
                f"a sequence-parallel group must be a power of two that divides the world size {world}, "
                f"got max_group={max_group}"
            )
        self.rank = rank
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        k = 2
        while k <= max_group:
            for start in range(0, world, k):
                ranks = tuple(range(start, start + k))
                self._groups[ranks] = dist.new_group(list(ranks), timeout=timeout)  # every rank creates every group
            k *= 2

    @property
    def blocks(self) -> list[tuple[int, ...]]:
        return list(self._groups)

    def connect(self, device: torch.device | int | str) -> None:
        """One collective in each group of this rank, in the order every rank builds them: a backend that sets
        a group up at its first collective (NCCL) does it now, not inside a mini-batch."""
        for ranks, group in self._groups.items():
            if self.rank in ranks:
                dist.all_reduce(torch.zeros(1, device=device), group=group)

    def close(self) -> None:
        """Destroy the groups (a group whose exchange failed may hold a peer's unread messages)."""
        for group in self._groups.values():
            dist.destroy_process_group(group)
        self._groups.clear()

    @contextlib.contextmanager
    def split(self, ranks: Sequence[int]) -> Iterator[SplitMember]:
        """Run a micro-batch split over `ranks` (a block; this rank among them): attention wrapped by
        `sequence_parallel_attention` then exchanges over the block."""
        ranks = tuple(ranks)
        if ranks not in self._groups:
            raise ValueError(f"ranks {list(ranks)} are not a block of these groups (blocks: {self.blocks})")
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} runs a micro-batch split over {list(ranks)}, which it is not in")
        split = SplitMember(ranks, ranks.index(self.rank), self._groups[ranks])
        token = _ACTIVE.set(split)
        try:
            yield split
        finally:
            _ACTIVE.reset(token)


class _AllToAll(torch.autograd.Function):
    """Row i of dim 0 goes to the group's i-th member, row j of the result came from the j-th; backward is
    the same exchange. (torch.distributed.nn's all_to_all falls back on gloo to scatters that name global
    ranks as group ranks, which fails in any group but the world.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # contiguous both ways: all_to_all_single reads and writes memory in order (empty_like would keep a
    # transposed input's strides)
    out = x.new_empty(x.shape)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _to_heads(x: torch.Tensor, split: SplitMember) -> torch.Tensor:
    """(batch, heads, tokens/k, dim) on each member -> (batch, heads/k, tokens, dim)."""
    b, h, s, d = x.shape
    k = split.size
    got = _AllToAll.apply(x.reshape(b, k, h // k, s, d).transpose(0, 1), split.group)  # (source, b, h/k, s, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // k, k * s, d)


def _to_tokens(x: torch.Tensor, split: SplitMember) -> torch.Tensor:
    """The inverse of _to_heads."""
    b, hk, ks, d = x.shape
    k = split.size
    got = _AllToAll.apply(x.reshape(b, hk, k, ks // k, d).permute(2, 0, 1, 3, 4), split.group)
    return got.transpose(0, 1).reshape(b, k * hk, ks // k, d)


def sequence_parallel_attention(attention: Callable) -> Callable:
    """A transformers attention function (query, key, value as (batch, heads, tokens, dim); returns
    (batch, tokens, heads, dim) and weights) that, inside `SequenceGroups.split`, attends over the whole
    sample from this member's slice; outside one it is `attention` unchanged."""

    @functools.wraps(attention)
    def attend(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        split = active_split()
        if split is None:
            return attention(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % split.size:
            raise ValueError(f"{heads} attention heads do not divide over a sequence-parallel group of {split.size}")
        if kv_heads % split.size:  # fewer kv heads than members: each member gets the ones its heads use
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        positions = [torch.empty_like(position_ids) for _ in split.ranks]
        dist.all_gather(positions, position_ids.contiguous(), group=split.group)
        out, _ = attention(
            module,
            _to_heads(query, split),
            _to_heads(key, split),
            _to_heads(value, split),
            attention_mask,
            *args,
            position_ids=torch.cat(positions, dim=1),
            **kwargs,
        )
        return _to_tokens(out.transpose(1, 2), split).transpose(1, 2).contiguous(), None

    return attend
