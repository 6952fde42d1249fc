"""Per-rank timelines: wall time spent inside communication, for stock FSDP2 and ODC alike.

What a rank does between two communication calls is compute; what it does inside one is moving bytes
or waiting for a slower peer. Wrapping FSDP2's default collectives and ODC's transport with the same
clock gives both runs the same definition of "idle".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from .comm import Region, Transport


@dataclass
class CommClock:
    """Intervals (start, end) of communication calls, in perf_counter seconds."""

    intervals: list[tuple[float, float]] = field(default_factory=list)

    def timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.intervals.append((start, time.perf_counter()))

    def take(self, since: float) -> list[tuple[float, float]]:
        """The intervals recorded since `since`, relative to it; the clock starts over."""
        out = [(a - since, b - since) for a, b in self.intervals if b >= since]
        self.intervals.clear()
        return out


class _TimedAllGather(AllGather):
    def __init__(self, clock: CommClock):
        self.clock, self.inner = clock, DefaultAllGather()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self.clock.timed(self.inner, output_tensor, input_tensor, group, async_op)


class _TimedReduceScatter(ReduceScatter):
    def __init__(self, clock: CommClock):
        self.clock, self.inner = clock, DefaultReduceScatter()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.clock.timed(self.inner, output_tensor, input_tensor, group, op, async_op)


def time_fsdp_collectives(model: torch.nn.Module, clock: CommClock) -> None:
    """Record FSDP2's own all-gathers and reduce-scatters (synchronous on CPU, so their full duration)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_TimedAllGather(clock))
            module.set_custom_reduce_scatter(_TimedReduceScatter(clock))


class TimedTransport(Transport):
    """A transport whose one-sided calls and barrier are recorded on a clock."""

    def __init__(self, inner: Transport, clock: CommClock):
        super().__init__(inner.rank, inner.world_size)
        self.inner, self.clock = inner, clock

    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> Region:
        return self.inner.alloc(name, numel, dtype)

    def get(self, region, peer, offset, out):
        self.clock.timed(self.inner.get, region, peer, offset, out)

    def accumulate(self, region, peer, offset, src):
        self.clock.timed(self.inner.accumulate, region, peer, offset, src)

    def wait_at_least(self, region, peer, offset, value, timeout_s, what):
        self.clock.timed(self.inner.wait_at_least, region, peer, offset, value, timeout_s, what)

    def barrier(self, timeout_s):
        self.clock.timed(self.inner.barrier, timeout_s)

    def signal(self, region, offset, value):
        self.inner.signal(region, offset, value)

    def synchronize(self):
        self.inner.synchronize()

    def close(self):
        self.inner.close()
