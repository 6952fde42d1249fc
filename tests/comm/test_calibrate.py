"""The calibration of ODC's transport against the group's collectives (odc_plugin/comm/calibrate.py), over
real shm ranks and gloo."""

from __future__ import annotations

import pytest

from odc_plugin.comm.calibrate import Bucket
from odc_plugin.launch import run_ranks

from . import calibrate_workers


def test_every_rank_measures_the_same_picks_the_faster_method_and_the_transport_uses_it():
    results = run_ranks(calibrate_workers.calibrated, 3)
    first = results[0]["result"]
    assert all(r["result"] == first for r in results)
    assert first.backend == "gloo" and first.world_size == 3
    assert first.buckets == (Bucket(3000, 2), Bucket(50_000))
    assert first.gather_bytes == 56_000 * 2 and first.reduce_bytes == 56_000 * 4
    assert sorted(first.accumulate_s) == ["direct", "slots"]
    assert first.chosen == min(first.accumulate_s, key=first.accumulate_s.get)
    assert all(t > 0 for t in (first.gather_s, first.all_gather_s, first.reduce_scatter_s))
    assert first.gather_ratio == first.all_gather_s / first.gather_s
    assert first.accumulate_ratio() == first.reduce_scatter_s / first.accumulate_s[first.chosen]
    assert first.slots_extra_bytes == 2 * 56_000 * 4
    for r in results:
        # the chosen method is the transport's now, and it adds exactly
        assert r["method"] == first.chosen and r["sums"] == [3.0] * 10
        assert r["bytes"] == 10 * 4 * (3 if first.chosen == "slots" else 1)
    metrics = first.metrics()
    assert metrics["odc/transport/ratio"] == first.ratio
    assert metrics[f"odc/transport/accumulate_{first.chosen}_chosen"] == 1.0
    line = first.summary()
    assert line.startswith(f"ODC's transport is {first.ratio:.2f}x gloo's collectives here") and "\n" not in line


@pytest.mark.parametrize("method", ["direct", "slots"])
def test_a_method_named_is_the_one_measured_and_used(method):
    results = run_ranks(calibrate_workers.calibrated, 2, [method])
    assert [r["method"] for r in results] == [method] * 2
    assert all(list(r["result"].accumulate_s) == [method] and r["sums"] == [2.0] * 10 for r in results)


def test_slots_are_left_out_where_their_memory_exceeds_the_budget():
    (result, *_) = (r["result"] for r in run_ranks(calibrate_workers.calibrated, 2, None, 1000))
    assert list(result.accumulate_s) == ["direct"] and result.chosen == "direct"
    assert "slots" in result.excluded and "slots not eligible" in result.summary()


def test_a_slow_link_shows_in_the_gather_ratio():
    fast = run_ranks(calibrate_workers.calibrated, 2, ["direct"])[0]["result"]
    slow = run_ranks(calibrate_workers.calibrated, 2, ["direct"], None, 0.01)[0]["result"]
    # 3 buckets' gets from 2 peers, 10 ms each: 60 ms more per pass
    assert slow.gather_s > fast.gather_s + 0.05 and slow.gather_ratio < fast.gather_ratio
