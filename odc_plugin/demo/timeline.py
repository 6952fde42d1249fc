"""Where each rank's time goes: compute, moving bytes, or waiting for a slower peer.

One clock wraps FSDP2's default collectives and ODC's transport alike, so every row of an A/B has the
same definitions. A one-sided call is either a transfer (get, accumulate) or a wait (for a peer's
published shards, at a barrier). A collective is both at once: the rank that arrives last waits for
no one, so the shortest duration of a collective over the ranks is its transfer time and each rank's
excess over that is its waiting (which needs the ranks to issue the same collectives in the same order,
as FSDP's lockstep does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule

from ..comm import DelegatingTransport, Transport
from ..fsdp._fsdp_internals import AllGather, DefaultAllGather, DefaultReduceScatter, ReduceScatter

TRANSFER, PUBLISHED, BARRIER, COLLECTIVE = "transfer", "published", "barrier", "collective"


@dataclass
class CommClock:
    """Intervals (start, end, kind) of communication calls, in perf_counter seconds, and the CPU seconds
    this process spent in the calls that wait (published flags, barriers, collectives)."""

    intervals: list[tuple[float, float, str]] = field(default_factory=list)
    wait_cpu_s: float = 0.0

    def timed(self, kind: str, fn, *args, **kwargs):
        # process_time, not thread_time: gloo's own threads do a collective's work while the caller waits
        cpu = time.process_time() if kind != TRANSFER else 0.0
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.intervals.append((start, time.perf_counter(), kind))
            if kind != TRANSFER:
                self.wait_cpu_s += time.process_time() - cpu

    def take(self, since: float) -> tuple[list[tuple[float, float, str]], float]:
        """The intervals recorded since `since`, relative to it, and the CPU seconds spent waiting; the
        clock starts over."""
        out = [(a - since, b - since, kind) for a, b, kind in self.intervals if b >= since]
        cpu = self.wait_cpu_s
        self.clear()
        return out, cpu

    def clear(self) -> None:
        self.intervals.clear()
        self.wait_cpu_s = 0.0


def breakdown(step_s: float, own_s: list[float], intervals: list[list[tuple[float, float, str]]]) -> list[dict]:
    """Per rank, seconds of compute, communication and waiting in one mini-batch of `step_s` seconds.

    own_s[r] is when rank r finished its own work; the rest of the mini-batch it waited for the others.
    """
    collectives = [[b - a for a, b, kind in ivs if kind == COLLECTIVE] for ivs in intervals]
    if len({len(c) for c in collectives}) > 1:
        raise ValueError(f"ranks issued different numbers of collectives: {[len(c) for c in collectives]}")
    floor = sum(min(durations) for durations in zip(*collectives))
    out = []
    for own, ivs, coll in zip(own_s, intervals, collectives):

        def total(*kinds, ivs=ivs):
            return sum(b - a for a, b, kind in ivs if kind in kinds)

        comm = total(TRANSFER) + floor
        wait = total(PUBLISHED, BARRIER) + sum(coll) - floor + (step_s - own)
        out.append(
            {
                "compute_s": step_s - comm - wait,
                "comm_s": comm,
                "wait_s": wait,
                "barriers": sum(kind == BARRIER for _, _, kind in ivs),
            }
        )
    return out


class _TimedAllGather(AllGather):
    def __init__(self, clock: CommClock):
        self.clock, self.inner = clock, DefaultAllGather()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self.clock.timed(COLLECTIVE, self.inner, output_tensor, input_tensor, group, async_op)


class _TimedReduceScatter(ReduceScatter):
    def __init__(self, clock: CommClock):
        self.clock, self.inner = clock, DefaultReduceScatter()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.clock.timed(COLLECTIVE, self.inner, output_tensor, input_tensor, group, op, async_op)


def time_fsdp_collectives(model: torch.nn.Module, clock: CommClock) -> None:
    """Record FSDP2's own all-gathers and reduce-scatters (synchronous on CPU, so their full duration)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_TimedAllGather(clock))
            module.set_custom_reduce_scatter(_TimedReduceScatter(clock))


class TimedTransport(DelegatingTransport):
    """A transport whose one-sided calls, waits and barriers are recorded on a clock."""

    def __init__(self, inner: Transport, clock: CommClock):
        super().__init__(inner)
        self.clock = clock

    def get(self, region, peer, offset, out):
        self.clock.timed(TRANSFER, self.inner.get, region, peer, offset, out)

    def accumulate(self, region, peer, offset, src):
        self.clock.timed(TRANSFER, self.inner.accumulate, region, peer, offset, src)

    def wait_at_least(self, region, peer, offset, value, timeout_s, what):
        self.clock.timed(PUBLISHED, self.inner.wait_at_least, region, peer, offset, value, timeout_s, what)

    def barrier(self, timeout_s):
        self.clock.timed(BARRIER, self.inner.barrier, timeout_s)

    def recover(self, timeout_s):
        return self.clock.timed(BARRIER, self.inner.recover, timeout_s)
