"""Input checks and helpers shared by both balancers, the limit no plan beats, and the balance metric."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

# Per GPU and direction, what collectives reach on H100 nodes: NVLink 4 carries 450 GB/s each way, of
# which NCCL reaches about 80%; one 400 Gb/s (NDR) InfiniBand NIC per GPU carries 50 GB/s, again ~80%.
NVLINK_BW = 360e9

IB_BW = 40e9

# Per rank, a list of micro-batches, each a list of sample indices into the mini-batch.
RankPlan = list[list[list[int]]]


def rank_shares(plan: RankPlan) -> list[list[int]]:
    """Per rank, the sample indices of a plan, its micro-batches flattened in order."""
    return [[i for mb in rank for i in mb] for rank in plan]


def check_minibatch(seqlens: Sequence[int], dp_size: int, max_token_len: int) -> list[int]:
    """Validate a balancer's inputs; returns the lengths as a list of ints."""
    if not isinstance(dp_size, numbers.Integral) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    if not isinstance(max_token_len, numbers.Integral) or max_token_len < 1:
        raise ValueError(f"max_token_len must be an integer >= 1, got {max_token_len!r}")
    lens = list(seqlens)
    for i, s in enumerate(lens):
        if not isinstance(s, numbers.Integral) or s < 0:
            raise ValueError(f"sequence length of sample {i} must be a non-negative integer, got {s!r}")
        if s > max_token_len:
            raise ValueError(f"sample {i} has {s} tokens, more than max_token_len={max_token_len}")
    return [int(s) for s in lens]


def chunk(samples: list[int], size: int) -> list[list[int]]:
    """Consecutive pieces of at most `size` samples: how verl's engine cuts a share for a fixed micro-batch size."""
    return [samples[i : i + size] for i in range(0, len(samples), size)]


# What minibatch_limit is, as the reports of a mini-batch's limit print it.
LIMIT_DEFINITION = "the larger of its work over the ranks' summed speeds and its longest sample on the fastest rank"


def minibatch_limit(costs: Sequence[float], slowdown: Sequence[float], throughput: float = 1.0) -> float:
    """The shortest time in which ranks of these slowdowns can run a mini-batch of samples costing `costs`,
    however it is split: the larger of its work over the ranks' summed speeds (no rank ever idle) and its
    longest sample on the fastest rank (a sample is never split). Every printed ideal is this one."""
    if not slowdown or min(slowdown) <= 0:
        raise ValueError(f"minibatch_limit needs one slowdown > 0 per rank, got {list(slowdown)!r}")
    work = sum(costs) / sum(1 / f for f in slowdown)
    return max(work, max(costs, default=0.0) * min(slowdown)) / throughput


def balance_efficiency(partitions: Sequence[Sequence], costs: Sequence[float] | None = None) -> float:
    """limit / makespan, in (0, 1]: 1 means no partition of these samples has a lower largest rank total.

    makespan is the largest rank total; limit = max(largest single sample, total / ranks), minibatch_limit
    of equal ranks, is a lower bound on the makespan of any partition. `partitions` holds per rank either
    sample costs (costs=None) or sample indices into `costs`; a rank may also be a list of micro-batches, as
    lb_mini returns.
    """
    ranks = []
    for rank in partitions:
        flat = [x for item in rank for x in (item if isinstance(item, Sequence) else [item])]
        ranks.append(flat if costs is None else [costs[i] for i in flat])
    if not ranks:
        raise ValueError("balance_efficiency needs at least one rank")
    total = sum(sum(r) for r in ranks)
    if total == 0:
        return 1.0
    limit = minibatch_limit([c for r in ranks for c in r], [1.0] * len(ranks))
    return limit / max(sum(r) for r in ranks)
