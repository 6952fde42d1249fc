"""The step-time model behind `odc-plan`: how long a mini-batch takes under FSDP+LB-Micro, ODC+LB-Micro
and ODC+LB-Mini (and ODC+LB-Mini splitting its longest samples over Ulysses groups), on one node or several.

FSDP's per-layer collectives make ranks move in lockstep: every micro-batch step lasts as long as its
slowest rank. Under ODC a rank only waits at the end of the mini-batch, so a mini-batch lasts as long
as the slowest rank's own sum. Work outside the micro-batch loop (optimizer step, final gradient
reduction) is the same in all three and left out. Across nodes (`cluster_table`) it compares FSDP2's
HSDP, ODC inside each node with one all-reduce across nodes, and flat ODC.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

from odc_plugin.balance.common import IB_BW, NVLINK_BW, RankPlan, balance_efficiency, minibatch_limit
from odc_plugin.balance.costs import PRESETS, CostModel, FlopsCost, get_cost_model, model_config
from odc_plugin.balance.lb_micro import lb_micro
from odc_plugin.balance.lb_mini import lb_mini
from odc_plugin.balance.split import Limit, Split, SplitPlan, UlyssesModel, group_finish, lb_mini_split, split_limit

# Every scheme a row may hold; the split one only where plan_table was given a UlyssesModel.
SPLIT_SCHEME = "odc_lb_mini_split"
SCHEMES = {
    "fsdp_lb_micro": "FSDP+LB-Micro",
    "odc_lb_micro": "ODC+LB-Micro",
    "odc_lb_mini": "ODC+LB-Mini",
    SPLIT_SCHEME: "ODC+LB-Mini+split",
}
# The scheme every PlanRow.speedup is over: verl's own fsdp2 with its dynamic batch size.
SPEEDUP_BASELINE = "fsdp_lb_micro"

# A report says so when a measured time is further than this from the planner's (relative): beyond it, what
# the rehearsal itself costs (or something the planner does not model) is a visible part of the step.
PLANNER_TOLERANCE = 0.10


def off_planner_note(errors: dict[str, float], what: str = "run") -> str | None:
    """One line naming the runs (label -> planner over measured, minus 1) beyond PLANNER_TOLERANCE; None if none."""
    off = {label: e for label, e in errors.items() if abs(e) > PLANNER_TOLERANCE}
    if not off:
        return None
    return (
        f"more than {PLANNER_TOLERANCE:.0%} off the planner: "
        + ", ".join(f"{label} ({e:+.1%})" for label, e in off.items())
        + f"; the planner models compute only, so in such a {what} something else (the rehearsal's own overhead "
        "on few cores, waits the planner does not know of) is a visible part of the step"
    )


def unbalanceable_note(minibatches: dict[str, tuple[int, int]]) -> str | None:
    """One line naming the mini-batches (label -> (samples, ranks)) with at most one sample per rank; None if
    none. There no plan can move work between ranks: every rank runs what it got whole."""
    few = {label: (n, ranks) for label, (n, ranks) in minibatches.items() if n <= ranks}
    if not few:
        return None
    return (
        ", ".join(f"{label} ({n} samples, {ranks} ranks)" for label, (n, ranks) in few.items())
        + ": at most one sample per rank, so nothing can be balanced (the longest sample is the step, whatever "
        "the plan); give several samples per rank, as verl jobs have, to see what balancing buys"
    )


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one micro-batch on one rank: max(compute, parameter communication), since both FSDP and
    ODC prefetch the next layer's parameters while computing the current one.

    throughput is cost units per second (FLOP/s for the flops cost; 1 for a fit in seconds).
    layer_comm_bytes is what a full layer moves per micro-batch (gathered parameters in forward and
    backward, plus gradients); each rank moves the (dp - 1) / dp it does not hold, over NVLink inside
    a node and over the network beyond one. 0 models compute only.
    """

    throughput: float = 1.0
    layer_comm_bytes: float = 0.0
    num_layers: int = 0
    intra_node_bw: float = NVLINK_BW
    inter_node_bw: float = IB_BW
    gpus_per_node: int = 8

    def __post_init__(self):
        for name in ("throughput", "intra_node_bw", "inter_node_bw", "gpus_per_node"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"StepTimeModel.{name} must be finite and > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.layer_comm_bytes) and self.layer_comm_bytes >= 0) or self.num_layers < 0:
            raise ValueError("StepTimeModel.layer_comm_bytes and num_layers must be >= 0")
        if self.layer_comm_bytes and not self.num_layers:
            raise ValueError("StepTimeModel.layer_comm_bytes needs num_layers")

    def comm_seconds(self, dp_size: int) -> float:
        bw = self.intra_node_bw if dp_size <= self.gpus_per_node else self.inter_node_bw
        return self.num_layers * self.layer_comm_bytes * (dp_size - 1) / dp_size / bw


@dataclass(frozen=True)
class MiniBatchTime:
    seconds: float
    idle_fraction: float  # share of rank-seconds in the mini-batch not spent computing


def simulate_minibatch(
    plan: RankPlan,
    costs: Sequence[float],
    *,
    lockstep: bool,
    model: StepTimeModel = StepTimeModel(),
    comm_s: float | None = None,
    slowdown: Sequence[float] | None = None,
    start: Sequence[float] | None = None,
) -> MiniBatchTime:
    """Time of one mini-batch run as `plan` (per rank, micro-batches of sample indices into costs);
    `comm_s`, when given, is each micro-batch's communication instead of the model's; `slowdown[r]`
    multiplies rank r's compute (a slower GPU); under ODC rank r begins at `start[r]` seconds (default 0).
    Idle is measured against each rank's own busy time."""
    comm = model.comm_seconds(len(plan)) if comm_s is None else comm_s
    slowdown = [1.0] * len(plan) if slowdown is None else list(slowdown)
    if len(slowdown) != len(plan):
        raise ValueError(f"slowdown has {len(slowdown)} entries for {len(plan)} ranks")
    compute = [[sum(costs[i] for i in mb) * f / model.throughput for mb in rank] for rank, f in zip(plan, slowdown)]
    if lockstep:
        if start is not None:
            raise ValueError("lockstep ranks start together; start is for ODC's ranks")
        counts = sorted({len(rank) for rank in compute})
        if len(counts) > 1:
            raise ValueError(f"lockstep ranks need equal micro-batch counts, got counts {counts}")
        seconds = sum(max(*step, comm) for step in zip(*compute))
    else:
        start = [0.0] * len(plan) if start is None else start
        seconds = max(t + sum(max(c, comm) for c in rank) for t, rank in zip(start, compute))
    busy = sum(map(sum, compute))
    return MiniBatchTime(seconds, 1 - busy / (len(plan) * seconds) if seconds else 0.0)


def simulate_split(
    plan: SplitPlan,
    costs: Sequence[float],
    seqlens: Sequence[int],
    ulysses: UlyssesModel,
    *,
    model: StepTimeModel = StepTimeModel(),
    slowdown: Sequence[float] | None = None,
) -> MiniBatchTime:
    """Time of one mini-batch run as a split plan under ODC: each split sample from when every member of its
    group is free, for its compute over k on the group's slowest member (or the parameter communication,
    which it overlaps) plus its all-to-alls, which nothing overlaps; then each rank's other micro-batches as
    simulate_minibatch runs them, without lockstep. A split's compute counts as busy on every member."""
    dp = len(plan.ranks)
    slowdown = [1.0] * dp if slowdown is None else list(slowdown)
    comm = model.comm_seconds(dp)

    def compute(s: Split) -> float:
        return costs[s.sample] / s.k * max(slowdown[r] for r in s.group) / model.throughput

    ready = group_finish(plan.splits, dp, lambda s: max(compute(s), comm) + ulysses.seconds(seqlens[s.sample], s.k))
    rest = simulate_minibatch(plan.ranks, costs, lockstep=False, model=model, slowdown=slowdown, start=ready)
    split_busy = sum(costs[s.sample] / s.k * slowdown[r] / model.throughput for s in plan.splits for r in s.group)
    busy = (1 - rest.idle_fraction) * dp * rest.seconds + split_busy
    return MiniBatchTime(rest.seconds, 1 - busy / (dp * rest.seconds) if rest.seconds else 0.0)


@dataclass(frozen=True)
class Comparison:
    times: dict[str, MiniBatchTime]  # per scheme
    efficiency: dict[str, float]  # balance_efficiency of the LB-Micro and LB-Mini rank totals, by the same cost
    limit_s: float  # minibatch_limit: no scheme can be faster
    split_limit: Limit | None = None  # split.split_limit: no scheme, splitting samples or not, can be faster


def compare_schemes(
    seqlens: Sequence[int],
    dp_size: int,
    max_token_len: int,
    cost: str | CostModel = "tokens",
    model: StepTimeModel = StepTimeModel(),
    micro_batch_size: int | None = None,
    ulysses: UlyssesModel | None = None,
    balance_ranks: bool = True,
) -> Comparison:
    """Plan one mini-batch with LB-Micro and LB-Mini and time it under the three schemes (with
    `micro_batch_size`, verl's fixed micro-batch size, instead of dynamic batch size; without `balance_ranks`,
    LB-Micro's ranks take their samplers' shares, `lb_micro`); with `ulysses`, also LB-Mini splitting its
    longest samples over Ulysses groups (split.lb_mini_split), and that scheme's limit."""
    cost = get_cost_model(cost)
    costs = cost.costs(seqlens)
    micro = lb_micro(seqlens, dp_size, max_token_len, micro_batch_size, balance_ranks)
    mini = lb_mini(seqlens, dp_size, max_token_len, cost=cost, baseline=micro, micro_batch_size=micro_batch_size)
    times = {
        "fsdp_lb_micro": simulate_minibatch(micro, costs, lockstep=True, model=model),
        "odc_lb_micro": simulate_minibatch(micro, costs, lockstep=False, model=model),
        "odc_lb_mini": simulate_minibatch(mini, costs, lockstep=False, model=model),
    }
    limit = None
    if ulysses is not None:
        split = lb_mini_split(
            seqlens,
            dp_size,
            max_token_len,
            cost,
            ulysses=ulysses,
            throughput=model.throughput,
            micro_batch_size=micro_batch_size,
            baseline=mini,
        )
        times[SPLIT_SCHEME] = simulate_split(split, costs, seqlens, ulysses, model=model)
        limit = split_limit(costs, seqlens, [1.0] * dp_size, ulysses, model.throughput)
    return Comparison(
        times=times,
        efficiency={"lb_micro": balance_efficiency(micro, costs), "lb_mini": balance_efficiency(mini, costs)},
        limit_s=minibatch_limit(costs, [1.0] * dp_size, model.throughput),
        split_limit=limit,
    )


def unrunnable(minibatch_size: int, dp_size: int, micro_batch_size: int | None = None) -> str | None:
    """Why verl could not run a mini-batch of `minibatch_size` samples over `dp_size` data-parallel units
    (with fixed micro-batches of `micro_batch_size`); None when it can."""
    if minibatch_size % dp_size:
        return f"{minibatch_size} samples do not divide over {dp_size} data-parallel ranks"
    if micro_batch_size and minibatch_size // dp_size % micro_batch_size:
        return f"{minibatch_size // dp_size} samples per rank do not divide into micro-batches of {micro_batch_size}"
    return None


def _skip(skipped: list[str] | None, what: str) -> None:
    if skipped is not None:
        skipped.append(what)


@dataclass
class PlanRow:
    """Means over the draws of one (ranks, mini-batch size) configuration."""

    dp_size: int  # data-parallel units: GPUs, or sequence-parallel groups of `sp` GPUs
    minibatch_size: int
    seconds: dict[str, float]
    idle_fraction: dict[str, float]
    efficiency: dict[str, float]
    limit_s: float  # minibatch_limit, the mean over the draws
    sp: int = 1
    # With the split scheme: split_limit's mean over the draws, and the share of draws its work bound decided.
    split_limit_s: float | None = None
    work_bound_share: float | None = None

    def speedup(self, scheme: str) -> float:
        return self.seconds[SPEEDUP_BASELINE] / self.seconds[scheme]

    def over_limit(self, scheme: str) -> float:
        """How far the scheme's time is above its limit (0: at it): the split scheme's is split_limit_s."""
        return self.seconds[scheme] / (self.split_limit_s if scheme == SPLIT_SCHEME else self.limit_s) - 1


def plan_table(
    draw: Callable[[int, int], list[int]],
    ranks: Sequence[int],
    minibatch_sizes: Sequence[int],
    max_token_len: int,
    cost: str | CostModel = "tokens",
    model: StepTimeModel = StepTimeModel(),
    draws: int = 5,
    seed: int = 0,
    sp_sizes: Sequence[int] = (1,),
    micro_batch_size: int | None = None,
    skipped: list[str] | None = None,
    ulysses: UlyssesModel | None = None,
    balance_ranks: bool = True,
) -> list[PlanRow]:
    """One row per (ranks, sequence-parallel size, mini-batch size) that divides evenly, as verl requires;
    `ranks` are GPUs; `draw(n, seed)` gives the lengths of one mini-batch of n samples. Every row sees the
    same draws. Each configuration left out, with why, is appended to `skipped` when given. With `ulysses`
    rows also hold the split scheme; under --sp groups of sp GPUs split over k groups, so max_group / sp of
    them (the all-to-alls between groups are modelled as between single GPUs)."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    rows = []
    for gpus in ranks:
        for sp in sp_sizes:
            name = f"ranks={gpus}" + (f" sp={sp}" if sp > 1 else "")
            if sp < 1 or gpus % sp:
                _skip(skipped, f"{name} ({gpus} GPUs do not divide into Ulysses groups of {sp})")
                continue
            dp, group_model = gpus // sp, replace(model, throughput=model.throughput * sp)
            groups = None if ulysses is None else replace(ulysses, max_group=max(1, ulysses.max_group // sp))
            for size in minibatch_sizes:
                if why := unrunnable(size, dp, micro_batch_size):
                    _skip(skipped, f"{name} mini-batch={size} ({why})")
                    continue
                runs = [
                    compare_schemes(
                        draw(size, seed + d),
                        dp,
                        max_token_len * sp,
                        cost,
                        group_model,
                        micro_batch_size,
                        groups,
                        balance_ranks,
                    )
                    for d in range(draws)
                ]
                schemes = runs[0].times
                limits = [r.split_limit for r in runs if r.split_limit is not None]
                rows.append(
                    PlanRow(
                        dp,
                        size,
                        seconds={s: statistics.fmean(r.times[s].seconds for r in runs) for s in schemes},
                        idle_fraction={s: statistics.fmean(r.times[s].idle_fraction for r in runs) for s in schemes},
                        efficiency={k: statistics.fmean(r.efficiency[k] for r in runs) for k in runs[0].efficiency},
                        limit_s=statistics.fmean(r.limit_s for r in runs),
                        sp=sp,
                        split_limit_s=statistics.fmean(lim.seconds for lim in limits) if limits else None,
                        work_bound_share=statistics.fmean(lim.bound == "work" for lim in limits) if limits else None,
                    )
                )
    return rows


CLUSTER_SCHEMES = {"fsdp_hsdp": "FSDP-HSDP+LB-Micro", "odc_hsdp": "ODC-HSDP+LB-Mini", "odc_flat": "flat ODC+LB-Mini"}
# What a pick may be: flat ODC is modelled (what it would take) but refused by this version's transports
# (odc_plugin.comm.select.flat_nvshmem_error), so it is never recommended.
RUNNABLE_CLUSTER_SCHEMES = ("fsdp_hsdp", "odc_hsdp")

# Qwen2.5 models whose config.json ties the LM head to the input embedding.
TIED_EMBEDDINGS = {"Qwen2.5-0.5B", "Qwen2.5-1.5B"}


def model_params(preset: str) -> int:
    """Parameters of a preset (or a model directory's config.json): its weight matrices (as FlopsCost counts
    them, head included; an MoE's every expert, all of which are communicated) plus the input embedding when
    the head is not tied to it."""
    config = model_config(preset)
    cost = FlopsCost.from_config(config).dense()
    tied = preset in TIED_EMBEDDINGS or (preset not in PRESETS and _get(config, "tie_word_embeddings"))
    embedding = 0 if tied else cost.vocab_size * cost.hidden_size
    return cost.linear_flops_per_token // 2 + embedding


def _get(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


@dataclass(frozen=True)
class ClusterModel:
    """Communication of data parallelism over `gpus_per_node`-GPU nodes, per GPU.

    Every micro-batch gathers each parameter twice (forward and backward, bf16: `param_bytes`) and
    reduces its gradient once (fp32: `grad_bytes`); a rank moves the part it does not hold, and both
    FSDP and ODC overlap it with compute (a micro-batch lasts max(compute, communication)).

    - fsdp_hsdp: shards inside a node; every backward also all-reduces each gradient shard across the
      nodes (verl's default, use_no_sync_for_gradient_accumulation=False), on its own links, overlapped.
    - odc_hsdp: shards inside a node; one all-reduce of the gradient shard across nodes after the
      mini-batch, not overlapped.
    - odc_flat: shards over every rank; (G - 1) / dp of the bytes over NVLink, (dp - G) / dp over the
      network, concurrently. NVSHMEM's host-driven accumulate (it folds only while the owner calls the
      transport) is not modelled, so this is flat ODC's best case.
    """

    model_params: float
    gpus_per_node: int = 8
    intra_node_bw: float = NVLINK_BW
    inter_node_bw: float = IB_BW
    param_bytes: int = 2
    grad_bytes: int = 4

    def __post_init__(self):
        for f in fields(self):
            if not (math.isfinite(getattr(self, f.name)) and getattr(self, f.name) > 0):
                raise ValueError(f"ClusterModel.{f.name} must be finite and > 0, got {getattr(self, f.name)}")

    def micro_batch_comm(self, scheme: str, nodes: int) -> float:
        g, dp = self.gpus_per_node, nodes * self.gpus_per_node
        moved = self.model_params * (2 * self.param_bytes + self.grad_bytes)
        if scheme == "odc_flat":
            return moved * max((g - 1) / dp / self.intra_node_bw, (dp - g) / dp / self.inter_node_bw)
        intra = moved * (g - 1) / g / self.intra_node_bw
        return max(intra, self.all_reduce_seconds(nodes)) if scheme == "fsdp_hsdp" else intra

    def all_reduce_seconds(self, nodes: int) -> float:
        """A ring all-reduce of one rank's fp32 gradient shard (1/G of the model) across the nodes."""
        shard = self.model_params * self.grad_bytes / self.gpus_per_node
        return 2 * (nodes - 1) / nodes * shard / self.inter_node_bw

    def end_seconds(self, scheme: str, nodes: int) -> float:
        return self.all_reduce_seconds(nodes) if scheme == "odc_hsdp" else 0.0


@dataclass
class ClusterRow:
    """Means over the draws of one (nodes, mini-batch size) configuration."""

    nodes: int
    gpus_per_node: int
    minibatch_size: int
    seconds: dict[str, float]
    idle_fraction: dict[str, float]
    all_reduce_s: float  # ODC-HSDP's end-of-mini-batch all-reduce
    flat_comm_s: float  # flat ODC's communication per micro-batch

    @property
    def pick(self) -> str:
        return min(RUNNABLE_CLUSTER_SCHEMES, key=self.seconds.__getitem__)


def compare_cluster(
    seqlens: Sequence[int],
    nodes: int,
    max_token_len: int,
    cost: CostModel,
    cluster: ClusterModel,
    throughput: float,
    micro_batch_size: int | None = None,
) -> dict[str, MiniBatchTime]:
    """One mini-batch over nodes x gpus_per_node ranks, LB-Micro for FSDP and LB-Mini over every rank for ODC."""
    dp = nodes * cluster.gpus_per_node
    costs = cost.costs(seqlens)
    micro = lb_micro(seqlens, dp, max_token_len, micro_batch_size)
    mini = lb_mini(seqlens, dp, max_token_len, cost=cost, baseline=micro, micro_batch_size=micro_batch_size)
    compute = StepTimeModel(throughput=throughput)
    times = {}
    for scheme, plan, lockstep in (("fsdp_hsdp", micro, True), ("odc_hsdp", mini, False), ("odc_flat", mini, False)):
        t = simulate_minibatch(
            plan, costs, lockstep=lockstep, model=compute, comm_s=cluster.micro_batch_comm(scheme, nodes)
        )
        seconds = t.seconds + cluster.end_seconds(scheme, nodes)
        times[scheme] = MiniBatchTime(seconds, 1 - (1 - t.idle_fraction) * t.seconds / seconds)
    return times


def cluster_table(
    draw: Callable[[int, int], list[int]],
    nodes: Sequence[int],
    minibatch_sizes: Sequence[int],
    max_token_len: int,
    cost: CostModel,
    cluster: ClusterModel,
    throughput: float,
    draws: int = 5,
    seed: int = 0,
    micro_batch_size: int | None = None,
    skipped: list[str] | None = None,
) -> list[ClusterRow]:
    """One row per (nodes, mini-batch size) whose size divides over the ranks; every node count sees the
    same draws. Each configuration left out, with why, is appended to `skipped` when given."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    rows = []
    for n in nodes:
        if n < 2:
            raise ValueError(f"--nodes compares multi-node set-ups; got {n} node(s)")
        for size in minibatch_sizes:
            if why := unrunnable(size, n * cluster.gpus_per_node, micro_batch_size):
                _skip(skipped, f"nodes={n} mini-batch={size} ({why})")
                continue
            runs = [
                compare_cluster(draw(size, seed + d), n, max_token_len, cost, cluster, throughput, micro_batch_size)
                for d in range(draws)
            ]
            rows.append(
                ClusterRow(
                    n,
                    cluster.gpus_per_node,
                    size,
                    seconds={s: statistics.fmean(r[s].seconds for r in runs) for s in CLUSTER_SCHEMES},
                    idle_fraction={s: statistics.fmean(r[s].idle_fraction for r in runs) for s in CLUSTER_SCHEMES},
                    all_reduce_s=cluster.all_reduce_seconds(n),
                    flat_comm_s=cluster.micro_batch_comm("odc_flat", n),
                )
            )
    return rows
