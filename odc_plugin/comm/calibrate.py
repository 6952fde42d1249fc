"""ODC's transport measured against the process group's own collectives, on the machine it runs on.

Whether ODC can win on a machine depends first on its one-sided transport keeping up with the collectives
FSDP would run instead (NCCL's all-gather and reduce-scatter on GPUs, gloo's on CPU): nobody has measured
that on a user's node but the user. So `calibrate` times, at the bucket sizes a model's FSDP groups have
(one rank's shard of each, `Bucket`), one forward's worth of each:

- ODC's gather (gets of every peer's shard) against the group's all-gather of the same bytes;
- ODC's accumulate, with each method the transport offers (base.ACCUMULATE_METHODS), of every bucket into
  every owner, and the barrier that completes them, against the group's reduce-scatter of the same;

and picks the faster accumulate method, alike on every rank (each time is the slowest rank's). Ratios are
the collective's time over ODC's: above 1, ODC's transport is faster. It is collective, allocates its
regions for the measurement only, and needs no accumulator to exist (the method is set for the next ones).
Nothing here knows FSDP: the caller names the buckets.

`calibrate_all_to_all` times the other collective ODC's plans lean on: the all-to-all of Ulysses sequence
parallelism, over aligned blocks of k ranks at a time (every block at once, as a split plan runs them), at
message sizes the caller names, and fits per k the line `latency_s + bytes sent / bandwidth` through them.
Nothing here knows the planner or the model either: the caller names the group sizes and the messages.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .base import Transport

# Regions of the measurement's own: named so that they cannot be one of the caller's.
_PARAMS, _ACCUMULATOR = "odc.calibrate.params", "odc.calibrate.accumulator"


@dataclass(frozen=True)
class Bucket:
    """`count` FSDP groups of one size, each rank owning `numel` elements of each."""

    numel: int
    count: int = 1


@dataclass(frozen=True)
class TransportCalibration:
    """What `calibrate` measured: seconds for one pass over every bucket, the slowest rank's."""

    backend: str
    """The process group's backend whose collectives ODC was measured against (nccl, gloo)."""
    world_size: int
    buckets: tuple[Bucket, ...]
    gather_bytes: int
    """Bytes of one rank's shards in the gathers' dtype (its share of one pass)."""
    reduce_bytes: int
    """Bytes of one rank's shards in the reduce dtype (its share of one pass)."""
    gather_s: float
    all_gather_s: float
    accumulate_s: dict[str, float]
    """Per accumulate method measured."""
    reduce_scatter_s: float
    chosen: str
    """The accumulate method set on the transport."""
    slots_extra_bytes: int
    """What "slots" would add per rank for an accumulator of every bucket: W - 1 more copies."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Methods offered but not eligible, and why."""

    @property
    def gather_ratio(self) -> float:
        """The group's all-gather time over ODC's gets: above 1, ODC's gather is faster."""
        return self.all_gather_s / self.gather_s

    def accumulate_ratio(self, method: str | None = None) -> float:
        """The group's reduce-scatter time over ODC's accumulates with `method` (default: the chosen one)."""
        return self.reduce_scatter_s / self.accumulate_s[method or self.chosen]

    @property
    def ratio(self) -> float:
        """One figure for the transport: the collectives' time over ODC's, gathers and accumulates together."""
        return (self.all_gather_s + self.reduce_scatter_s) / (self.gather_s + self.accumulate_s[self.chosen])

    def metrics(self, prefix: str = "odc/transport/") -> dict[str, float]:
        """As verl metrics: ratios, seconds, and which method was chosen (1.0 for it, 0.0 for the others)."""
        values = {
            f"{prefix}ratio": self.ratio,
            f"{prefix}gather_ratio": self.gather_ratio,
            f"{prefix}accumulate_ratio": self.accumulate_ratio(),
            f"{prefix}gather_s": self.gather_s,
            f"{prefix}all_gather_s": self.all_gather_s,
            f"{prefix}reduce_scatter_s": self.reduce_scatter_s,
        }
        for method, seconds in self.accumulate_s.items():
            values[f"{prefix}accumulate_{method}_s"] = seconds
            values[f"{prefix}accumulate_{method}_chosen"] = float(method == self.chosen)
        return values

    def summary(self) -> str:
        """One line: the ratios against the group's collectives and the method chosen, with the others."""
        others = "; ".join(
            f"{m} {self.accumulate_ratio(m):.2f}x" for m in self.accumulate_s if m != self.chosen
        ) + "".join(f"; {m} not eligible ({why})" for m, why in self.excluded.items())
        return (
            f"ODC's transport is {self.ratio:.2f}x {self.backend}'s collectives here "
            f"(gather {self.gather_ratio:.2f}x all-gather, accumulate '{self.chosen}' {self.accumulate_ratio():.2f}x "
            f"reduce-scatter{'; ' + others if others else ''}; >1: ODC faster; {self.world_size} ranks, "
            f"{self.gather_bytes / 2**20:.1f} MiB gathered and {self.reduce_bytes / 2**20:.1f} MiB reduced per rank)"
        )


def calibrate(
    transport: Transport,
    group: dist.ProcessGroup | None,
    buckets: Sequence[Bucket],
    *,
    gather_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    methods: Sequence[str] | None = None,
    slots_budget_bytes: int | None = None,
    repeats: int = 2,
    timeout_s: float = 600.0,
) -> TransportCalibration:
    """Collective over `group` (the transport's ranks): measure, pick the fastest of `methods` (default: every
    method the transport offers) and set it on the transport. "slots" is left out where its extra memory for
    these buckets exceeds `slots_budget_bytes` (None: no bound). Every rank returns the same."""
    if not buckets or any(b.numel < 1 or b.count < 1 for b in buckets):
        raise ValueError(f"calibrate needs buckets of numel >= 1 and count >= 1, got {list(buckets)}")
    world = transport.world_size
    offered = transport.accumulate_methods()
    methods = list(methods or offered)
    unknown = [m for m in methods if m not in offered]
    if unknown:
        name = type(transport).__name__
        raise ValueError(f"{name} offers the accumulate method(s) {', '.join(offered)}, not {unknown}")
    numel_total = sum(b.numel * b.count for b in buckets)
    slots_extra = (world - 1) * numel_total * 4
    excluded = {}
    if "slots" in methods and slots_budget_bytes is not None and slots_extra > slots_budget_bytes and len(methods) > 1:
        methods.remove("slots")
        excluded["slots"] = f"its {slots_extra / 2**30:.1f} GiB more per rank exceed the memory left for it"
    largest = max(b.numel for b in buckets)

    params = transport.alloc(_PARAMS, largest * gather_dtype.itemsize, torch.uint8, timeout_s)
    device = params.local.device
    gathered = torch.empty(world, largest, dtype=gather_dtype, device=device)
    try:
        shard = params.local.view(gather_dtype)

        def gets() -> None:
            for b in buckets:
                for _ in range(b.count):
                    for step in range(world):
                        peer = (transport.rank + step) % world
                        transport.get(params, peer, 0, gathered[peer, : b.numel].view(torch.uint8))

        def all_gathers() -> None:
            for b in buckets:
                for _ in range(b.count):
                    dist.all_gather_into_tensor(gathered[:, : b.numel].reshape(-1), shard[: b.numel], group=group)

        timings = {"gather": _seconds(gets, device, repeats), "all_gather": _seconds(all_gathers, device, repeats)}
    finally:
        transport.free(_PARAMS)
    grads = torch.ones(world, largest, dtype=reduce_dtype, device=device)
    reduced = torch.empty(largest, dtype=reduce_dtype, device=device)

    def reduce_scatters() -> None:
        for b in buckets:
            for _ in range(b.count):
                dist.reduce_scatter_tensor(reduced[: b.numel], grads[:, : b.numel].reshape(-1), group=group)

    timings["reduce_scatter"] = _seconds(reduce_scatters, device, repeats)
    initial = transport.accumulate_method
    for method in methods:
        transport.set_accumulate_method(method)
        accumulator = transport.alloc(_ACCUMULATOR, largest, torch.float32, timeout_s)
        try:

            def accumulates(accumulator=accumulator) -> None:
                for b in buckets:
                    for _ in range(b.count):
                        for step in range(world):
                            peer = (transport.rank + step) % world
                            transport.accumulate(accumulator, peer, 0, grads[peer, : b.numel])
                transport.barrier(timeout_s)

            timings[f"accumulate_{method}"] = _seconds(accumulates, device, repeats)
        finally:
            del accumulator
            transport.free(_ACCUMULATOR)
            transport.set_accumulate_method(initial)
    # every rank decides on the slowest rank's times, so all pick the same
    names = sorted(timings)
    slowest = torch.tensor([timings[n] for n in names], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    timings = dict(zip(names, slowest.tolist()))
    accumulate_s = {m: timings[f"accumulate_{m}"] for m in methods}
    chosen = min(accumulate_s, key=lambda m: (accumulate_s[m], m != "direct"))
    transport.set_accumulate_method(chosen)
    return TransportCalibration(
        backend=str(dist.get_backend(group)),
        world_size=world,
        buckets=tuple(buckets),
        gather_bytes=numel_total * gather_dtype.itemsize,
        reduce_bytes=numel_total * reduce_dtype.itemsize,
        gather_s=timings["gather"],
        all_gather_s=timings["all_gather"],
        accumulate_s=accumulate_s,
        reduce_scatter_s=timings["reduce_scatter"],
        chosen=chosen,
        slots_extra_bytes=slots_extra,
        excluded=excluded,
    )


def _seconds(
    run: Callable[[], None], device: torch.device, repeats: int, align: Callable[[], None] | None = None
) -> float:
    """Median seconds of `run`, after one untimed run (first launches compile kernels, allocate, set up a new
    group's communicator); `align`, untimed, before each (ranks that start together)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    with warnings.catch_warnings():
        # torch 2.13 names all_gather_into_tensor and reduce_scatter_tensor deprecated; torch 2.11 has no other
        warnings.simplefilter("ignore", FutureWarning)
        for i in range(repeats + 1):
            if align is not None:
                align()
            sync()
            start = time.perf_counter()
            run()
            sync()
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


# A fitted start-up time below this is the small message's noise, not a latency: no all-to-all starts faster.
MIN_LATENCY_S = 1e-6


@dataclass(frozen=True)
class AllToAllCalibration:
    """What `calibrate_all_to_all` measured: per group size k, the slowest rank's median seconds of one
    all_to_all_single at each message size, and the line fitted through them."""

    backend: str
    world_size: int
    message_bytes: tuple[int, ...]
    """Each rank's buffer per all-to-all, ascending: it keeps 1/k of it and sends (k - 1)/k, 1/k to each peer."""
    repeats: int
    """Timed samples per point (each `iters` all-to-alls back to back); the median is kept."""
    seconds: dict[int, tuple[float, ...]]
    """Per k: seconds of one all-to-all at each of `message_bytes`, the slowest rank's median."""
    latency_s: dict[int, float]
    """Per k: the fit's start-up time of one all-to-all (at least MIN_LATENCY_S)."""
    bandwidth: dict[int, float]
    """Per k: the fit's bytes per second per rank and direction (what each rank sends of its buffer, over time)."""

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(self.seconds)

    @property
    def worst_latency_s(self) -> float:
        """The largest latency of any k: with `worst_bandwidth`, a line that no k's fit lies above."""
        return max(self.latency_s.values())

    @property
    def worst_bandwidth(self) -> float:
        """The slowest group size's bandwidth."""
        return min(self.bandwidth.values())


def fit_all_to_all(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency_s, bandwidth) of the line t = latency_s + sent / bandwidth through (sent bytes, seconds) points,
    least squares in relative error (so that the small messages set the latency and the large ones the
    bandwidth). Where the points are too noisy for a rising line, the largest message's time is all transfer
    and the smallest's all latency; the latency is at least MIN_LATENCY_S."""
    if len(points) < 2 or len({x for x, _ in points}) < 2 or any(not (x > 0 and t > 0) for x, t in points):
        raise ValueError(f"fit_all_to_all needs two or more message sizes, bytes and seconds > 0, got {list(points)}")
    w = [1 / t**2 for _, t in points]
    s = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = s * sxx - sx * sx
    slope = (s * sxt - sx * st) / det if det > 0 else 0.0
    if not (slope > 0 and math.isfinite(slope)):
        largest = max(points)
        return max(min(t for _, t in points), MIN_LATENCY_S), largest[0] / largest[1]
    latency = (st - slope * sx) / s
    return max(latency, MIN_LATENCY_S), 1 / slope


def calibrate_all_to_all(
    group: dist.ProcessGroup | None,
    group_sizes: Sequence[int],
    message_bytes: Sequence[int],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 5,
    iters: int = 3,
) -> AllToAllCalibration:
    """Collective over `group` (None: the default group): time dist.all_to_all_single over every aligned
    block of k of its ranks at once, for each k of `group_sizes` (powers of two >= 2 dividing its size),
    at each of `message_bytes` (bytes of a rank's buffer, two or more sizes; each rounded up to whole
    elements of `dtype` per rank of the largest k). Each point is the median of `repeats` samples of `iters`
    all-to-alls, after one untimed; every rank returns the slowest rank's times and the same fit.

    A k below the group's size runs on new groups (dist.new_group, destroyed at the end), which every
    rank of the job must create: then `group` must be the whole job."""
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    sizes = sorted(set(group_sizes))
    if not sizes or any(k < 2 or k & (k - 1) or world % k for k in sizes):
        raise ValueError(f"group sizes must be powers of two >= 2 dividing the {world} ranks, got {list(group_sizes)}")
    if sizes[0] < world and world != dist.get_world_size():
        raise ValueError("groups smaller than `group` are made by every rank of the job: pass the whole job's group")
    if repeats < 1 or iters < 1:
        raise ValueError(f"repeats and iters must be >= 1, got {repeats} and {iters}")
    unit = sizes[-1] * dtype.itemsize
    messages = sorted({math.ceil(b / unit) * unit for b in message_bytes if b > 0})
    if len(messages) < 2 or any(b <= 0 for b in message_bytes):
        raise ValueError(f"calibrate_all_to_all needs two or more message sizes > 0, got {list(message_bytes)}")
    me = dist.get_rank()
    flag = torch.zeros(1, device=device)

    def align() -> None:
        # every block starts together, as a plan's split samples run: one small all-reduce over the group
        dist.all_reduce(flag, group=group)

    medians = []
    for k in sizes:
        block, made = group, []
        if k < world:
            for first in range(0, world, k):  # every rank makes every block, in the same order
                made.append(dist.new_group(ranks[first : first + k]))
                if me in ranks[first : first + k]:
                    block = made[-1]
        for nbytes in messages:
            send = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
            recv = torch.empty_like(send)

            def all_to_alls(recv=recv, send=send, block=block) -> None:
                for _ in range(iters):
                    dist.all_to_all_single(recv, send, group=block)

            medians.append(_seconds(all_to_alls, device, repeats, align) / iters)
        # done with (a failure leaves them to the job's end: destroying a group a peer died in may wait on it)
        for g in made:
            dist.destroy_process_group(g)
    # every rank fits the slowest rank's times, so all return the same
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    values = slowest.tolist()
    seconds, latency, bandwidth = {}, {}, {}
    for i, k in enumerate(sizes):
        seconds[k] = tuple(values[i * len(messages) : (i + 1) * len(messages)])
        latency[k], bandwidth[k] = fit_all_to_all([(b * (k - 1) / k, t) for b, t in zip(messages, seconds[k])])
    return AllToAllCalibration(
        backend=str(dist.get_backend(group)),
        world_size=world,
        message_bytes=tuple(messages),
        repeats=repeats,
        seconds=seconds,
        latency_s=latency,
        bandwidth=bandwidth,
    )
