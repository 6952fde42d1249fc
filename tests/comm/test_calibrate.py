"""The calibration of ODC's transport against the group's collectives (odc_plugin/comm/calibrate.py), over
real shm ranks and gloo; and of the Ulysses all-to-all (calibrate_all_to_all), its fit alone and over gloo."""

from __future__ import annotations

import pytest

from odc_plugin.comm.calibrate import MIN_LATENCY_S, AllToAllCalibration, Bucket, fit_all_to_all
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


def test_the_all_to_all_fit_recovers_a_line_and_keeps_to_it_when_the_points_are_noise():
    # 50 us to start, 100 GB/s: exact points give exactly the line back
    line = [(x, 50e-6 + x / 100e9) for x in (1e4, 1e6, 3e7)]
    latency, bandwidth = fit_all_to_all(line)
    assert latency == pytest.approx(50e-6) and bandwidth == pytest.approx(100e9)
    # a larger message measured no slower: all its time is transfer, the smallest's all start-up
    assert fit_all_to_all([(1e4, 2e-3), (1e6, 1e-3)]) == (1e-3, 1e6 / 1e-3)
    # a line through zero or below: the latency is held at its floor
    assert fit_all_to_all([(1e4, 1e-7), (1e6, 1e-4)])[0] == MIN_LATENCY_S
    with pytest.raises(ValueError, match="two or more message sizes"):
        fit_all_to_all([(1e4, 1e-3), (1e4, 2e-3)])


def test_the_all_to_all_over_blocks_of_2_and_all_4_ranks_is_positive_and_the_same_on_every_rank():
    results = run_ranks(calibrate_workers.all_to_all, 4, [4, 2], [1001, 2**16, 2**18])
    first = results[0]
    assert isinstance(first, AllToAllCalibration) and all(r == first for r in results)
    assert (first.backend, first.world_size, first.group_sizes, first.repeats) == ("gloo", 4, (2, 4), 3)
    # rounded up to whole bf16 elements for each of the largest group's ranks
    assert first.message_bytes == (1008, 2**16, 2**18)
    for k in (2, 4):
        assert len(first.seconds[k]) == 3 and all(t > 0 for t in first.seconds[k])
        assert first.latency_s[k] >= MIN_LATENCY_S and first.bandwidth[k] > 0
    assert first.worst_latency_s == max(first.latency_s.values())
    assert first.worst_bandwidth == min(first.bandwidth.values())
