"""Input checks shared by both balancers, and the balance metric used to compare them."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

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


def balance_efficiency(partitions: Sequence[Sequence], costs: Sequence[float] | None = None) -> float:
    """limit / makespan, in (0, 1]: 1 means no partition of these samples has a lower largest rank total.

    makespan is the largest rank total; limit = max(largest single sample, total / ranks) is a lower
    bound on the makespan of any partition. `partitions` holds per rank either sample costs (costs=None)
    or sample indices into `costs`; a rank may also be a list of micro-batches, as lb_mini returns.
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
    limit = max(max((c for r in ranks for c in r), default=0), total / len(ranks))
    return limit / max(sum(r) for r in ranks)
