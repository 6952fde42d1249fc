"""The `auto` cost model: the online fit of micro-batch times, and LB-Mini balancing by it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_plugin.balance import lb_mini
from odc_plugin.balance.online_fit import MicroBatchTime, OnlineTimeFit, fit_micro_batch_times, lb_mini_auto

C, A, B = 0.02, 1.5e-9, 2e-5


def synthetic_timings(n: int, ranks: int, slow: dict[int, float], seed: int = 0, outliers: float = 0.02):
    """Micro-batches of 1-4 sequences of 100-8000 tokens, c + sum a*s^2 + b*s seconds times the rank's
    slowdown, 5% lognormal noise, and a few timings 3x too long (a preempted rank)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lengths = tuple(int(s) for s in rng.integers(100, 8000, rng.integers(1, 5)))
        rank = i % ranks
        seconds = (C + sum(A * s * s + B * s for s in lengths)) * slow.get(rank, 1.0)
        seconds *= rng.lognormal(0, 0.05) * (3.0 if rng.random() < outliers else 1.0)
        out.append(MicroBatchTime(rank, lengths, float(seconds)))
    return out


def test_the_fit_recovers_c_a_b_and_a_rank_made_1_5x_slow_from_noisy_timings():
    fit = fit_micro_batch_times(synthetic_timings(400, 8, {3: 1.5}), 8)
    assert fit.c == pytest.approx(C, rel=0.05)
    assert fit.a == pytest.approx(A, rel=0.05)
    assert fit.b == pytest.approx(B, rel=0.05)
    assert fit.speeds[3] == pytest.approx(1 / 1.5, rel=0.10)
    assert all(v == pytest.approx(1.0, rel=0.05) for r, v in enumerate(fit.speeds) if r != 3)


def test_the_window_follows_a_rank_that_slows_down():
    online = OnlineTimeFit(4, window=128)
    online.add(synthetic_timings(128, 4, {}, seed=1))
    assert min(online.fit.speeds) > 0.9
    online.add(synthetic_timings(128, 4, {2: 2.0}, seed=2))
    assert online.fit.speeds[2] == pytest.approx(0.5, rel=0.10)


def test_too_few_timings_give_no_fit():
    assert fit_micro_batch_times(synthetic_timings(5, 2, {}), 2) is None
    same = [MicroBatchTime(0, (100,), 0.1)] * 20
    assert fit_micro_batch_times(same, 1) is None
    assert OnlineTimeFit(2).add(synthetic_timings(3, 2, {})) is None


def test_bad_timings_are_refused():
    with pytest.raises(ValueError, match="does not fit 2 ranks"):
        fit_micro_batch_times([MicroBatchTime(5, (100,), 0.1)] * 10 + synthetic_timings(10, 2, {}), 2)


def test_lb_mini_gives_a_slow_rank_work_in_proportion_to_its_speed():
    rng = np.random.default_rng(0)
    lens = [int(s) for s in rng.integers(200, 4000, 64)]
    speeds = [1.0, 1.0, 1.0, 0.5]
    plan = lb_mini(lens, 4, 8192, rank_speed=speeds)
    work = [sum(lens[i] for mb in rank for i in mb) for rank in plan]
    times = [w / v for w, v in zip(work, speeds)]
    ideal = sum(lens) / sum(speeds)
    assert max(times) < 1.02 * ideal
    assert work[3] == pytest.approx(sum(lens) / 7, rel=0.05)
    # the speed-blind plan leaves the slow rank with a quarter of the work: twice the ideal's time
    blind = lb_mini(lens, 4, 8192)
    assert sum(lens[i] for mb in blind[3] for i in mb) / 0.5 > 1.7 * ideal


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(20, 1000), min_size=1, max_size=24),
    st.integers(1, 4),
    st.sampled_from([0.0, 100.0, 1000.0, 5000.0]),
)
def test_with_a_micro_batch_cost_lb_mini_is_never_slower_than_without(lens, dp, cost_per_micro_batch):
    """Time of a rank: its tokens plus the micro-batch cost per micro-batch it actually runs."""

    def makespan(plan):
        return max(sum(lens[i] for mb in rank for i in mb) + cost_per_micro_batch * len(rank) for rank in plan)

    aware = lb_mini(lens, dp, 1000, micro_batch_cost=cost_per_micro_batch)
    assert sorted(i for rank in aware for mb in rank for i in mb) == list(range(len(lens)))
    assert makespan(aware) <= makespan(lb_mini(lens, dp, 1000)) + 1e-9


@pytest.mark.parametrize(
    "speeds,message", [([1.0], "rank_speed needs 2 values > 0"), ([1.0, 0.0], "rank_speed needs 2 values > 0")]
)
def test_bad_speeds_are_refused(speeds, message):
    with pytest.raises(ValueError, match=message):
        lb_mini([1, 2, 3], 2, 10, rank_speed=speeds)


def test_a_machine_uniformly_slower_than_when_fitted_leaves_the_error_small():
    """A neighbour's job slows every rank alike: the predicted times miss by 2x, the predicted balance
    between the ranks (all LB-Mini weighs) does not, and a 3x slow rank is still given less work."""
    online = OnlineTimeFit(4, window=512)
    for seed in range(4):
        online.add(synthetic_timings(32, 4, {2: 3.0}, seed=seed, outliers=0.0))
    for seed in range(4, 8):
        online.add(synthetic_timings(32, 4, dict.fromkeys(range(4), 2.0) | {2: 6.0}, seed=seed, outliers=0.0))
    assert online.fit.error < 0.1
    equal = [[[i] for i in range(r * 2, r * 2 + 2)] for r in range(4)]
    assert lb_mini_auto([1000] * 8, 4, 8192, online.fit, None, baseline=equal) != equal


def test_the_fit_follows_its_own_prediction_error_and_trusts_itself_no_further():
    online = OnlineTimeFit(4, window=512)
    for seed in range(4):  # a steady job: the next mini-batch is predicted to within the noise
        online.add(synthetic_timings(32, 4, {}, seed=seed, outliers=0.0))
    assert online.fit.error < 0.1
    for seed in range(4, 8):  # rank 2 turns 3x slow: the predictions miss until the window has seen it
        online.add(synthetic_timings(32, 4, {2: 3.0}, seed=seed, outliers=0.0))
    # (each of those mini-batches' balance was predicted 19-42% off; the median over the window's 7)
    assert online.fit.error > 0.15 and online.fit.min_gain == online.fit.error

    lens = [1000] * 8
    equal = [[[i] for i in range(r * 2, r * 2 + 2)] for r in range(4)]
    slow = dataclasses.replace(online.fit, speeds=(1.0, 1.0, 0.5, 1.0), error=0.0)
    moved = lb_mini_auto(lens, 4, 8192, slow, None, baseline=equal)
    assert moved != equal  # the slow rank's second sample goes elsewhere: a 33% gain
    unsure = dataclasses.replace(slow, error=0.4)
    assert lb_mini_auto(lens, 4, 8192, unsure, None, baseline=equal) == equal  # but not on a fit 40% off
