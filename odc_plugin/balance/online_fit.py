"""The `auto` cost model: micro-batch times measured while training, fitted as they come.

A calibration run on the user's own GPU gives the best costs, and few users make one; fits also differ
a lot between set-ups. So every rank times its micro-batches, all ranks share the timings, and the fit

    seconds of a micro-batch on rank r = (c + sum over its sequences of a*s^2 + b*s) / speed[r]

is refitted over a window of recent micro-batches. `c` is what a micro-batch costs whatever its length
(under ODC it gathers every layer's parameters again and launches its kernels again): LB-Mini packs
with it and so adds a micro-batch to a rank only where that pays. `speed` is each rank's relative
speed (1 for a typical rank, 0.67 for one that takes 1.5x as long): LB-Mini gives each rank work in
proportion to it, which no lockstep trainer can use, since there the slowest rank paces every layer.

The fit minimizes relative error (a 32k-token micro-batch takes a hundred times a short one's time),
keeps a, b, c >= 0, and drops timings far off the fit (a preempted rank, a page fault storm) before it
settles. Its error, which LB-Mini's predicted gain must exceed, is how far off its predictions of the
ranks' balance have been, not of their times. Pure numpy: no process group, no transport.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from odc_plugin.balance.common import RankPlan
from odc_plugin.balance.costs import CostModel
from odc_plugin.balance.lb_mini import MIN_GAIN, lb_mini

# Timings the fit looks back over: enough to see every rank several times, recent enough to follow a
# rank that slows down.
DEFAULT_WINDOW = 512
# The fit needs this many timings, of at least 3 different token totals, before it replaces the prior.
MIN_TIMINGS = 8
# Mini-batches over which the fit's prediction error is followed.
ERROR_WINDOW = 8
# A timing whose time is off the fit by more than this factor of the median deviation is left out.
_OUTLIER_MADS = 4.0


@dataclass(frozen=True)
class MicroBatchTime:
    """One micro-batch as a rank ran it: which rank, its sequences' lengths, its compute seconds."""

    rank: int
    lengths: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class TimeFit(CostModel):
    """Seconds of a micro-batch: (c + sum a*s^2 + b*s) / speeds[rank]; `timings` it was fitted on; `error`,
    how far off its predictions of a mini-batch's balance (its slowest rank over the ranks' mean) have
    recently been (relative, median). As
    a cost model, a sequence's seconds on a rank of speed 1."""

    a: float
    b: float
    c: float
    speeds: tuple[float, ...]
    timings: int
    error: float = 0.0

    name: ClassVar[str] = "auto"

    def __call__(self, seqlen: int) -> float:
        return self.a * seqlen * seqlen + self.b * seqlen

    @property
    def min_gain(self) -> float:
        """The smallest predicted gain worth leaving a baseline split for: no less than this fit's error (a
        fit that has been 10% off does not get to move samples for 5%)."""
        return max(MIN_GAIN, self.error)

    def micro_batch_seconds(self, lengths: Sequence[int], rank: int = 0) -> float:
        return (self.c + sum(self(s) for s in lengths)) / self.speeds[rank]


def lb_mini_auto(
    seqlens: Sequence[int],
    dp_size: int,
    max_token_len: int,
    fit: TimeFit | None,
    prior: CostModel,
    baseline: RankPlan | None = None,
) -> RankPlan:
    """LB-Mini with the `auto` cost: the fit's sequence costs, micro-batch cost and rank speeds, or the
    prior's costs while there is no fit yet; it leaves `baseline` (see lb_mini) only for more than the
    fit's error."""
    if fit is None:
        return lb_mini(seqlens, dp_size, max_token_len, cost=prior, baseline=baseline)
    if len(fit.speeds) != dp_size:
        raise ValueError(f"the auto cost was fitted for {len(fit.speeds)} ranks, the plan is for {dp_size}")
    return lb_mini(
        seqlens,
        dp_size,
        max_token_len,
        cost=fit,
        rank_speed=fit.speeds,
        micro_batch_cost=fit.c,
        baseline=baseline,
        min_gain=fit.min_gain,
    )


def fit_micro_batch_times(timings: Sequence[MicroBatchTime], num_ranks: int, iterations: int = 4) -> TimeFit | None:
    """The least-relative-error fit of `timings`, or None while there are too few to say anything."""
    if len(timings) < MIN_TIMINGS or len({sum(t.lengths) for t in timings}) < 3:
        return None
    bad = [t for t in timings if not 0 <= t.rank < num_ranks or t.seconds <= 0 or not t.lengths]
    if bad:
        raise ValueError(f"timing {bad[0]} does not fit {num_ranks} ranks, or has no time or no sequence")
    ranks = np.array([t.rank for t in timings])
    x = np.array([[1.0, float(sum(s * s for s in t.lengths)), float(sum(t.lengths))] for t in timings])
    y = np.array([t.seconds for t in timings])
    keep = np.ones(len(y), dtype=bool)
    speeds = np.ones(num_ranks)
    coef = np.zeros(3)
    for it in range(iterations):
        coef = _nonnegative_relative_lstsq(x[keep], y[keep] * speeds[ranks[keep]])
        base = x @ coef  # seconds on a rank of speed 1
        if not (base > 0).all():
            return None
        ratio = base / y  # each timing's speed
        for r in range(num_ranks):
            mine = ratio[(ranks == r) & keep]
            speeds[r] = float(np.median(mine)) if len(mine) else math.nan
        known = speeds[~np.isnan(speeds)]
        speeds = np.where(np.isnan(speeds), 1.0, speeds / np.median(known))
        if it < iterations - 1:
            deviation = np.abs(np.log(base / (y * speeds[ranks])))
            spread = float(np.median(deviation[keep])) or 1e-3
            keep = deviation <= _OUTLIER_MADS * spread
    a, b, c = coef[1], coef[2], coef[0]
    return TimeFit(float(a), float(b), float(c), tuple(float(v) for v in speeds), len(timings))


def _nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin over coef >= 0 of the sum of (x @ coef / y - 1)^2, by trying every set of free columns (three
    columns: eight sets) and keeping the best feasible one."""
    rows = x / y[:, None]
    ones = np.ones(len(y))
    best, best_err = np.zeros(x.shape[1]), math.inf
    for size in range(1, x.shape[1] + 1):
        for free in itertools.combinations(range(x.shape[1]), size):
            sub = np.linalg.lstsq(rows[:, free], ones, rcond=None)[0]
            if (sub < 0).any():
                continue
            coef = np.zeros(x.shape[1])
            coef[list(free)] = sub
            err = float(np.sum((rows @ coef - ones) ** 2))
            if err < best_err:
                best, best_err = coef, err
    return best


def _imbalance(rank_seconds: Sequence[float]) -> float:
    """The slowest rank's time over the ranks' mean."""
    return max(rank_seconds) * len(rank_seconds) / sum(rank_seconds)


class OnlineTimeFit:
    """Micro-batch timings of every rank over a sliding window, and their latest fit."""

    def __init__(self, num_ranks: int, window: int = DEFAULT_WINDOW):
        if num_ranks < 1 or window < MIN_TIMINGS:
            raise ValueError(
                f"OnlineTimeFit needs num_ranks >= 1 and window >= {MIN_TIMINGS}, got {num_ranks}, {window}"
            )
        self.num_ranks = num_ranks
        self.timings: deque[MicroBatchTime] = deque(maxlen=window)
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self.fit: TimeFit | None = None

    def add(self, timings: Iterable[MicroBatchTime]) -> TimeFit | None:
        """Take one mini-batch's timings (of all ranks): check the current fit's prediction of how much its
        slowest rank exceeds the ranks' mean against them, then refit. LB-Mini weighs two plans under one
        fit, so a machine uniformly slower than when fitted (a neighbour's job) changes no decision: what
        the error follows is a wrong balance between ranks."""
        timings = list(timings)
        if self.fit is not None and sum(t.seconds for t in timings) > 0:
            measured, predicted = [0.0] * self.num_ranks, [0.0] * self.num_ranks
            for t in timings:
                measured[t.rank] += t.seconds
                predicted[t.rank] += self.fit.micro_batch_seconds(t.lengths, t.rank)
            self.errors.append(abs(_imbalance(predicted) / _imbalance(measured) - 1))
        self.timings.extend(timings)
        fit = fit_micro_batch_times(list(self.timings), self.num_ranks)
        if fit is not None:
            self.fit = dataclasses.replace(fit, error=float(np.median(self.errors)) if self.errors else 0.0)
        return self.fit
