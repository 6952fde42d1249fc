"""Past the longest sample: LB-Mini with a mini-batch's longest samples split over Ulysses groups.

LB-Mini never cuts a sample, so a mini-batch lasts at least its longest sample on the fastest rank; with
few samples per rank and long-tailed lengths (long-context SFT, one sample per rank) that sample is the step
and the other ranks wait. Split over a group of k ranks by Ulysses sequence parallelism (each rank holds
s/k of its tokens, and around attention every token of heads/k heads) it runs in 1/k of its compute, plus
the all-to-alls between the two layouts.

A plan runs the split samples first, each as one micro-batch on every member of its group, in plan order;
a group is an aligned block of k consecutive ranks, k a power of two dividing the rank count (the groups
ODC builds once at start). LB-Mini then balances the other samples over the time each rank has left. This
module plans and bounds; odc_plugin.balance.step_time.simulate_split times a plan, and
odc_plugin.fsdp.ulysses runs its split micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from odc_plugin.balance.common import NVLINK_BW, RankPlan, check_minibatch
from odc_plugin.balance.costs import CostModel, FlopsCost, get_cost_model, model_config
from odc_plugin.balance.lb_mini import MIN_GAIN, lb_mini

# Modelled, not measured: NCCL's all-to-all over one H100 node's NVLink starts in some 10-30 us whatever
# its size; the middle of that.
A2A_LATENCY_S = 20e-6


def heads_limit(num_heads: int, num_kv_heads: int, cap: int) -> int:
    """The largest power-of-two group, at most `cap`, that verl's Ulysses accepts for these heads: the heads
    divide over it, and the kv heads divide over it or it over them (verl then repeats each kv head)."""
    k = 1
    while 2 * k <= cap and num_heads % (2 * k) == 0 and (num_kv_heads % (2 * k) == 0 or 2 * k % num_kv_heads == 0):
        k *= 2
    return k


@dataclass(frozen=True)
class UlyssesModel:
    """What a sample of s tokens costs beside its compute over k when split over a Ulysses group of k ranks:
    the all-to-alls. Each rank holds s/k tokens and sends the (k - 1)/k of their activations that other
    ranks' heads need, `bytes_per_token` per token over every layer, forward and backward, at `bandwidth` per
    GPU and direction; each of the `all_to_alls` also costs `latency_s`. `max_group` is the largest k.

    Modelled unless given: from_config's bandwidth is NVLINK_BW (80% of an H100's NVLink 4) and its latency
    A2A_LATENCY_S; odc-check measures both where it runs (comm/calibrate.py: calibrate_all_to_all), and the
    engine options odc_split_bandwidth and odc_split_latency_s hand them to the planner.
    """

    max_group: int = 1
    bytes_per_token: float = 0.0
    all_to_alls: int = 0
    bandwidth: float = NVLINK_BW
    latency_s: float = A2A_LATENCY_S

    def __post_init__(self):
        if self.max_group < 1 or self.max_group & (self.max_group - 1):
            raise ValueError(f"UlyssesModel.max_group must be a power of two >= 1, got {self.max_group}")
        if not (self.bytes_per_token >= 0 and self.all_to_alls >= 0 and self.latency_s >= 0 and self.bandwidth > 0):
            raise ValueError("UlyssesModel needs bytes_per_token, all_to_alls, latency_s >= 0 and bandwidth > 0")

    @classmethod
    def from_config(
        cls, model, gpus_per_node: int = 8, bandwidth: float | None = None, latency_s: float | None = None
    ) -> UlyssesModel:
        """For a preset or a model's config (as odc_plugin.balance.costs.model_config takes them). Groups stay
        inside a node: across the network the all-to-alls would cost about what the split saves. So a group
        size divides the node's GPUs too (ranks fill nodes in order, so an aligned block of such a size never
        spans two: with 6 a node, blocks of 4 would). Where verl
        repeats kv heads (fewer than k) the repeated copies are not counted. `bandwidth` (bytes/s per GPU and
        direction) and `latency_s` (seconds per all-to-all) as measured; None: the modelled NVLINK_BW and
        A2A_LATENCY_S."""
        c = FlopsCost.from_config(model_config(model))
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        # Forward: q, k and v into the head layout and attention's output back, bf16; backward: their gradients.
        return cls(
            max_group=heads_limit(c.num_attention_heads, c.num_key_value_heads, gpus_per_node & -gpus_per_node),
            bytes_per_token=c.num_hidden_layers * 2 * 2 * (2 * q + 2 * kv),
            all_to_alls=c.num_hidden_layers * 2 * 4,
            bandwidth=NVLINK_BW if bandwidth is None else bandwidth,
            latency_s=A2A_LATENCY_S if latency_s is None else latency_s,
        )

    def seconds(self, seqlen: int, k: int) -> float:
        if k == 1:
            return 0.0
        return self.bytes_per_token * seqlen / k * (k - 1) / k / self.bandwidth + self.all_to_alls * self.latency_s

    def group_sizes(self, dp_size: int) -> list[int]:
        """What a sample may run over on dp_size ranks: 1 (whole), then the powers of two up to max_group that
        divide dp_size, so that aligned blocks tile the ranks."""
        sizes = [1]
        while 2 * sizes[-1] <= self.max_group and dp_size % (2 * sizes[-1]) == 0:
            sizes.append(2 * sizes[-1])
        return sizes


@dataclass(frozen=True)
class Split:
    sample: int
    k: int
    first: int  # its group is ranks first .. first + k - 1

    @property
    def group(self) -> range:
        return range(self.first, self.first + self.k)


@dataclass(frozen=True)
class SplitPlan:
    splits: tuple[Split, ...]  # run first, in this order, each on every rank of its group
    ranks: RankPlan  # then, per rank, its micro-batches of the other samples
    # lb_mini_split's predictions (cost over speed): this plan's mini-batch, and LB-Mini's unsplit one
    seconds: float = 0.0
    unsplit_seconds: float = 0.0


def group_finish(splits: Sequence[Split], dp_size: int, duration: Callable[[Split], float]) -> list[float]:
    """Per rank, when its split samples are done: each starts once every member of its group is free (its
    all-to-alls need them all) and holds them all for its duration."""
    ready = [0.0] * dp_size
    for s in splits:
        end = max(ready[r] for r in s.group) + duration(s)
        for r in s.group:
            ready[r] = end
    return ready


@dataclass(frozen=True)
class Limit:
    seconds: float
    bound: str  # which bound decided: "work" or "sample"


def split_limit(
    costs: Sequence[float],
    seqlens: Sequence[int],
    slowdown: Sequence[float],
    ulysses: UlyssesModel,
    throughput: float = 1.0,
) -> Limit:
    """No plan that may split samples as `ulysses` allows runs these samples faster: the larger of the work
    bound (the work over the ranks' summed speeds, plus the all-to-alls of splitting every sample longer than
    that at the smallest k that brings it under, spread over the ranks) and the longest unsplittable piece
    (the longest sample at its best k, all-to-alls included, on the fastest ranks). With max_group 1 it is
    common.minibatch_limit."""
    sizes = ulysses.group_sizes(len(slowdown))
    fastest, speed = min(slowdown), sum(1 / f for f in slowdown)
    work = sum(costs) / speed / throughput
    comm = 0.0
    for c, s in zip(costs, seqlens):
        whole = c * fastest / throughput
        if whole > work:
            k = next((k for k in sizes if whole / k <= work), sizes[-1])
            comm += k * ulysses.seconds(s, k)
    work += comm / len(slowdown)
    piece = max(
        (min(c * fastest / k / throughput + ulysses.seconds(s, k) for k in sizes) for c, s in zip(costs, seqlens)),
        default=0.0,
    )
    return Limit(work, "work") if work >= piece else Limit(piece, "sample")


def lb_mini_split(
    seqlens: Sequence[int],
    dp_size: int,
    max_token_len: int,
    cost: str | CostModel = "tokens",
    *,
    ulysses: UlyssesModel,
    throughput: float = 1.0,
    rank_speed: Sequence[float] | None = None,
    micro_batch_size: int | None = None,
    baseline: RankPlan | None = None,
    min_gain: float = MIN_GAIN,
) -> SplitPlan:
    """LB-Mini's plan with the mini-batch's longest samples split over Ulysses groups where that is predicted
    at least `min_gain` faster; otherwise LB-Mini's plan (`baseline` when given: the plan to beat), unsplit.

    Each candidate plan has a target time: every sample longer than it on the fastest rank is split, over the
    smallest k that brings its piece (compute over k plus all-to-alls) under it, or the largest allowed;
    those run first, larger groups first, each on the aligned block that is free earliest; LB-Mini balances
    the rest over what each rank has left. The targets tried are the pieces of the dp_size longest samples
    above split_limit, and a few below it, and the fastest plan is kept. Times are predicted as LB-Mini
    predicts them, cost over speed; `throughput` (cost per second) puts the all-to-alls in that unit.

    Long because the candidate plans share the samples' costs, the speeds and the limit; each step is
    commented in place.
    """
    lens = check_minibatch(seqlens, dp_size, max_token_len)
    cost = get_cost_model(cost)
    costs = cost.costs(lens)
    speeds = [1.0] * dp_size if rank_speed is None else [float(v) for v in rank_speed]
    plain = SplitPlan(
        (),
        baseline
        if baseline is not None
        else lb_mini(lens, dp_size, max_token_len, cost, rank_speed=speeds, micro_batch_size=micro_batch_size),
    )

    def duration(s: Split) -> float:
        slowest = min(speeds[r] for r in s.group)
        return costs[s.sample] / s.k / slowest + throughput * ulysses.seconds(lens[s.sample], s.k)

    def predict(plan: SplitPlan) -> float:
        ready = group_finish(plan.splits, dp_size, duration)
        return max(t + sum(costs[i] for mb in rank for i in mb) / v for t, rank, v in zip(ready, plan.ranks, speeds))

    sizes = ulysses.group_sizes(dp_size)
    bound = throughput * split_limit(costs, lens, [1 / v for v in speeds], ulysses, throughput).seconds
    plain_time = predict(plain)
    plain = replace(plain, seconds=plain_time, unsplit_seconds=plain_time)
    # Nothing to win where no plan, split or not, could be min_gain faster: most mini-batches of many
    # samples per rank, which LB-Mini already brings near the work bound.
    if len(sizes) == 1 or bound > plain_time * (1 - min_gain):
        return plain

    def piece(i: int, k: int) -> float:
        return costs[i] / k / max(speeds) + throughput * ulysses.seconds(lens[i], k)

    candidates = sorted(range(len(lens)), key=lambda i: (-costs[i], i))[:dp_size]

    def split_at(target: float) -> SplitPlan:
        chosen = []  # (k, sample), the larger groups placed first: aligned blocks nest, so small ones fit after
        for i in candidates:
            if costs[i] / max(speeds) > target:
                chosen.append((next((k for k in sizes[1:] if piece(i, k) <= target), sizes[-1]), i))
        splits: list[Split] = []
        for k, i in sorted(chosen, key=lambda ki: (-ki[0], -costs[ki[1]])):
            ready = group_finish(splits, dp_size, duration)
            first = min(range(0, dp_size, k), key=lambda f: (max(ready[f : f + k]), f))
            splits.append(Split(i, k, first))
        ready = group_finish(splits, dp_size, duration)
        rest = sorted(set(range(len(lens))) - {s.sample for s in splits})
        ranks = lb_mini(
            [lens[i] for i in rest],
            dp_size,
            max_token_len,
            cost,
            rank_speed=speeds,
            micro_batch_size=micro_batch_size,
            rank_start=ready,
        )
        return SplitPlan(tuple(splits), [[[rest[j] for j in mb] for mb in rank] for rank in ranks])

    # Above the bound every piece is a target; below it a few steps down to bound / max_group, where pieces
    # are cut finer than the step needs only so that they pack around the samples left whole.
    ladder = {bound * 2 ** (-j / 2) for j in range(2 * len(sizes) - 1)}
    targets = sorted(ladder | {p for i in candidates for k in sizes[1:] if (p := piece(i, k)) > bound}, reverse=True)
    best = min((split_at(t) for t in targets), key=predict)
    best_time = predict(best)
    if best_time > plain_time * (1 - min_gain):
        return plain
    return replace(best, seconds=best_time, unsplit_seconds=plain_time)
