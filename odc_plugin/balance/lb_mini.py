"""LB-Mini: balance each rank's total work in a mini-batch, free of equal sample or micro-batch counts.

With ODC, ranks only meet at the end of a mini-batch, so what must be equal is the sum of a rank's work,
not its work per micro-batch. Ranks are balanced with the multiway largest differencing method
(Karmarkar-Karp), then a local search exchanges samples between the busiest rank and lighter ones;
each rank's samples are then packed into as few micro-batches as the token budget allows (first-fit
decreasing), since every micro-batch re-gathers the parameters.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left
from collections.abc import Hashable, Sequence

from odc_plugin.balance.common import RankPlan, check_minibatch
from odc_plugin.balance.costs import CostModel, get_cost_model


def lb_mini(
    seqlens: Sequence[int],
    dp_size: int,
    max_token_len: int,
    cost: str | CostModel = "tokens",
    group_ids: Sequence[Hashable] | None = None,
) -> RankPlan:
    """Per rank, micro-batches of sample indices, largest (by cost) first.

    Samples sharing a group id (the GRPO responses of one prompt) stay on one rank. Every micro-batch
    holds at most max_token_len tokens; ranks may get different numbers of samples and micro-batches,
    and ranks are empty when there are fewer samples (or groups) than ranks.
    """
    lens = check_minibatch(seqlens, dp_size, max_token_len)
    costs = get_cost_model(cost).costs(lens)
    if group_ids is None:
        units = [[i] for i in range(len(lens))]
    else:
        if len(group_ids) != len(lens):
            raise ValueError(f"group_ids has {len(group_ids)} entries for {len(lens)} samples")
        by_group: dict[Hashable, list[int]] = {}
        for i, g in enumerate(group_ids):
            by_group.setdefault(g, []).append(i)
        units = list(by_group.values())
    weights = [sum(costs[i] for i in unit) for unit in units]
    # Two starts, each refined, the better kept: differencing single units is the stronger start in general,
    # differencing sorted runs of dp_size units (what verl's equal-size partition does) the stronger when
    # there are only a few units per rank.
    candidates = [_refine(_largest_differencing(weights, dp_size, chunk), weights) for chunk in (1, dp_size)]
    rank_units = min(candidates, key=lambda ranks: max(sum(weights[u] for u in r) for r in ranks))
    plan = []
    for unit_ids in rank_units:
        samples = [i for u in unit_ids for i in units[u]]
        plan.append(_pack(samples, lens, costs, max_token_len))
    return plan


def _largest_differencing(weights: list[float], k: int, chunk: int) -> list[list[int]]:
    """Multiway Karmarkar-Karp: repeatedly combine the two partial partitions with the largest spread,
    pairing the heaviest part of one with the lightest part of the other. The starting partial partitions
    hold `chunk` consecutive units of the weight order, one per part."""
    if not weights:
        return [[] for _ in range(k)]
    tiebreak = itertools.count()
    heap = []
    order = sorted(range(len(weights)), key=lambda u: (-weights[u], u))
    for start in range(0, len(order), chunk):
        # A part's members are kept as a tree of (left, right) pairs so that joining two parts is O(1).
        units = order[start : start + chunk]
        sums = [weights[u] for u in units] + [0] * (k - len(units))
        heap.append((sums[-1] - sums[0], -sums[0], next(tiebreak), sums, units + [None] * (k - len(units))))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, _, sums_a, parts_a = heapq.heappop(heap)
        _, _, _, sums_b, parts_b = heapq.heappop(heap)
        sums = [a + b for a, b in zip(sums_a, reversed(sums_b))]
        parts = [a if b is None else b if a is None else (a, b) for a, b in zip(parts_a, reversed(parts_b))]
        order = sorted(range(k), key=sums.__getitem__, reverse=True)
        sums = [sums[i] for i in order]
        parts = [parts[i] for i in order]
        heapq.heappush(heap, (sums[-1] - sums[0], -sums[0], next(tiebreak), sums, parts))
    return [_flatten(p) for p in heap[0][4]]


def _flatten(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        elif node is not None:
            out.append(node)
    return sorted(out)


# Subsets one side of an exchange may enumerate: enough to repartition a pair of 8-unit ranks exactly,
# small enough that the search stays a few milliseconds.
_SUBSET_BUDGET = 512


def _refine(ranks: list[list[int]], weights: list[float]) -> list[list[int]]:
    """Lower the busiest rank by exchanging units with a lighter rank until no exchange helps: one unit
    each way at most against every lighter rank, then the largest subsets the budget allows against the
    lightest, where there is most room. Large subsets matter when ranks hold few units, and those are
    exactly the ranks whose subsets are few."""
    sums = [sum(weights[u] for u in r) for r in ranks]
    # Float costs could in principle let tiny gains go on for long; every unit moving a few times is plenty.
    for _ in range(4 * len(weights)):
        hi = max(range(len(ranks)), key=sums.__getitem__)
        lighter = [r for r in sorted(range(len(ranks)), key=sums.__getitem__) if sums[r] < sums[hi]]
        searches = [(lo, 1, 1) for lo in lighter]
        if lighter:
            sizes = (_max_subset_size(len(ranks[hi])), _max_subset_size(len(ranks[lighter[0]])))
            if sizes != (1, 1):
                searches.append((lighter[0], *sizes))
        for lo, give_size, take_size in searches:
            exchange = _best_exchange(ranks[hi], ranks[lo], sums[hi] - sums[lo], weights, give_size, take_size)
            if exchange is not None:
                break
        else:
            return ranks
        give, take = exchange
        for u in give:
            ranks[hi].remove(u)
            ranks[lo].append(u)
        for u in take:
            ranks[lo].remove(u)
            ranks[hi].append(u)
        delta = sum(weights[u] for u in give) - sum(weights[u] for u in take)
        sums[hi] -= delta
        sums[lo] += delta
    return ranks


def _max_subset_size(n: int) -> int:
    """The largest size s such that the subsets of n units of size 0..s fit in the budget (at least 1)."""
    size = 1
    while size < n and sum(math.comb(n, k) for k in range(size + 2)) <= _SUBSET_BUDGET:
        size += 1
    return size


def _best_exchange(hi: list[int], lo: list[int], gap: float, weights: list[float], give_size: int, take_size: int):
    """Units (give from hi, take from lo), at most give_size and take_size of them and give non-empty,
    whose weight difference d lies in (0, gap) and is closest to gap / 2: both ranks then end below
    hi's old total."""
    take_options = sorted(_subsets(lo, weights, take_size))
    take_sums = [w for w, _ in take_options]
    best, best_gain = None, 0
    for w_give, give in _subsets(hi, weights, give_size)[1:]:
        j = bisect_left(take_sums, w_give - gap / 2)
        for k in (j - 1, j):
            if 0 <= k < len(take_sums):
                d = w_give - take_sums[k]
                gain = min(d, gap - d)
                if gain > best_gain:
                    best, best_gain = (give, take_options[k][1]), gain
    return best


def _subsets(units: list[int], weights: list[float], max_size: int) -> list[tuple[float, tuple[int, ...]]]:
    """(weight, units) of every subset of at most max_size units, the empty one first."""
    subsets = [(0, ())]
    level = [(0, (), -1)]  # subsets of the current size, with the position of their last unit
    for _ in range(max_size):
        level = [
            (w + weights[units[j]], combo + (units[j],), j)
            for w, combo, last in level
            for j in range(last + 1, len(units))
        ]
        subsets += [(w, combo) for w, combo, _ in level]
    return subsets


def _pack(samples: list[int], lens: list[int], costs: list[float], max_token_len: int) -> list[list[int]]:
    """First-fit decreasing by tokens, then the costliest micro-batch first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(samples, key=lambda i: (-lens[i], i)):
        for b, free in enumerate(room):
            if lens[i] <= free:
                bins[b].append(i)
                room[b] -= lens[i]
                break
        else:
            bins.append([i])
            room.append(max_token_len - lens[i])
    return sorted(bins, key=lambda b: (-sum(costs[i] for i in b), min(b)))
