"""The shared-memory transport with real processes."""

import re

import pytest
import torch

from odc_plugin.comm import make_transport
from odc_plugin.launch import run_ranks

from . import shm_workers, transport_workers


@pytest.mark.parametrize("method", ["direct", "slots"])
def test_concurrent_accumulates_lose_nothing_and_gets_read_peers(method):
    world, rounds = 3, 200
    results = run_ranks(shm_workers.concurrent_accumulate, world, rounds, method)
    expected = rounds * sum(r + 1 for r in range(world))
    for rank, res in enumerate(results):
        assert torch.equal(res["acc"], torch.full((1000,), float(expected))), rank
        for peer, got in enumerate(res["pulled"]):
            assert torch.equal(got, torch.arange(8, 24, dtype=torch.uint8) + peer)


def test_barrier_timeout_names_the_missing_rank():
    results = run_ranks(transport_workers.late_rank, 3, "shm", 2)
    for rank in (0, 1):
        # rank 2 skips the barrier and exits: its peers stop waiting once its process is gone, or at the timeout
        ended = r"(timed out after 1s|failed \(rank 2's process \(pid \d+\) has exited\))"
        assert re.fullmatch(rf"rank {rank}: ODC barrier #1 {ended}; rank\(s\) \[2\] did not arrive", results[rank])


def test_rank_arriving_after_its_peers_gave_up_fails_at_that_barrier():
    results = run_ranks(transport_workers.late_rank, 3, "shm", 2, 3.0)
    for rank in (0, 1):
        assert results[rank] == f"rank {rank}: ODC barrier #1 timed out after 1s; rank(s) [2] did not arrive"
    assert results[2] == (
        "rank 2: ODC barrier #1 failed: rank(s) [0, 1] timed out waiting at it and gave up before every rank arrived"
    )


def test_out_of_range_access_is_a_clear_error():
    (errors,) = run_ranks(shm_workers.bad_ranges, 1)
    assert errors == ["range [8, 12) outside region 'r' of 10 elements", "peer 1 out of range for world size 1"]


def test_unknown_transport_is_a_clear_error():
    import pytest

    with pytest.raises(ValueError, match="unknown ODC transport 'tcp'"):
        make_transport("tcp")


def test_a_failure_notice_fails_the_waiting_peers_at_once_and_recovery_starts_a_clean_round():
    results = run_ranks(shm_workers.failure_rounds, 3)
    for rank in (0, 2):
        message, elapsed = results[rank]["round 0"]
        assert message == f"rank {rank}: rank 1 failed in its mini-batch: RuntimeError: first", message
        assert elapsed < 5, elapsed  # the barrier's timeout is 600 s
    # after the meeting every rank reads the same notices, and the add rank 1 made before failing has landed
    assert all(r["notices 0"] == [(1, "RuntimeError: first")] for r in results)
    assert results[0]["accumulator"] == [1.0] * 4
    # round 1: the round-0 notice is gone; the barrier rank 1 waits at fails naming a round-1 failure
    message, elapsed = results[1]["round 1"]
    assert message.startswith("rank 1: rank ") and "failed in its mini-batch: ValueError: from rank" in message
    assert elapsed < 5, elapsed
    assert all(r["notices 1"] == [(0, "ValueError: from rank 0"), (2, "ValueError: from rank 2")] for r in results)
    assert all(r["round 2"] == "passed" for r in results)


def test_a_barrier_counts_a_peer_only_within_its_round():
    from odc_plugin.comm import Transport
    from odc_plugin.comm.failure import ROUND_SHIFT

    recovery, first_of_round_1 = 1 << ROUND_SHIFT, (1 << ROUND_SHIFT) + 1
    assert Transport.arrived(3, 3) and Transport.arrived(4, 3) and not Transport.arrived(2, 3)
    # a peer gone to the recovery meeting has not arrived at a barrier of the round it left ...
    assert not Transport.arrived(recovery, 3)
    # ... the meeting counts peers already in the next round, which counts from the meeting on
    assert Transport.arrived(recovery, recovery) and Transport.arrived(first_of_round_1, recovery)
    assert not Transport.arrived(recovery, first_of_round_1) and not Transport.arrived(5, first_of_round_1)
    assert [Transport.barrier_name(e) for e in (3, recovery, first_of_round_1)] == [
        "ODC barrier #3",
        "ODC recovery meeting #1",
        "ODC barrier #1 of round 1",
    ]


def test_freeing_a_region_still_viewed_drops_it_and_unmaps_it_with_the_last_view():
    world = 2
    results = run_ranks(shm_workers.free_while_viewed, world)
    for rank, res in enumerate(results):
        mapped, after_free = res["mapped"]
        assert after_free == mapped - (world - 1) * 32, rank  # gone from the transport at once
        assert res["held"] == res["held after"] == [rank + 1.0] * 8, rank  # the view reads what it read
        assert res["again"] == [10.0] * 4, rank  # the name is a new region, which peers reach
        assert f"-r-r{rank}-p" in res["path"], res["path"]  # the view was this rank's shm file ...
        assert not res["still mapped"], rank  # ... unmapped once the view went, with no GC pass


def test_misuse_is_refused_up_front_and_changes_nothing():
    results = run_ranks(shm_workers.misuse_changes_nothing, 2)
    for rank, res in enumerate(results):
        assert res["alloc"] == [
            "ValueError: numel of region 'r' must be >= 1, got 0",
            "ValueError: numel of region 'r' must be >= 1, got -1",
            "TypeError: numel of region 'r' must be an int, got True",
            "TypeError: numel of region 'r' must be an int, got 2.0",
            "TypeError: dtype of region 'r' must be a torch.dtype, got 'float32'",
            "ValueError: region name must be a non-empty str without '/' or NUL, got ''",
            "ValueError: region name must be a non-empty str without '/' or NUL, got 'a/b'",
            "ValueError: region name must be a non-empty str without '/' or NUL, got 'a\\x00b'",
            "ValueError: region name 'odc.barrier' is the transport's own control words; choose another name",
        ]
        assert res["again"] == "ValueError: region 'r' is already allocated; free('r') it first or choose another name"
        assert res["free"] == [
            "ValueError: no region 'nope' to free: it was never allocated or is already freed",
            "ValueError: region 'odc.failure' is the transport's own control words; close() releases them",
        ]
        assert res["transfers"] == [
            "TypeError: out is torch.int64 but region 'r' is torch.float32; convert it to torch.float32 "
            "(no transport casts silently)",
            "TypeError: src is torch.float64 but region 'r' is torch.float32; convert it to torch.float32 "
            "(no transport casts silently)",
            "TypeError: out must be a torch.Tensor, got list",
            "ValueError: src is on meta but region 'r' is on cpu",
        ]
        # both ranks met at the same two barriers, after the two meetings of the region's set-up: none of
        # rank 1's refused waits counted as an arrival
        assert res["epoch"] == 4, res["epoch"]
        # only the bf16 add landed, once
        assert res["local"] == [1.0 + k + 10 * rank for k in range(4)], res["local"]
    assert results[1]["waits"] == [
        "TypeError: timeout_s must be a number of seconds, got None",
        "ValueError: timeout_s must be a finite number of seconds > 0, got nan",
        "ValueError: timeout_s must be a finite number of seconds > 0, got inf",
        "ValueError: timeout_s must be a finite number of seconds > 0, got 0",
        "ValueError: timeout_s must be a finite number of seconds > 0, got -1.0",
        "TypeError: timeout_s must be a number of seconds, got True",
        "TypeError: timeout_s must be a number of seconds, got '5'",
        "ValueError: timeout_s must be a finite number of seconds > 0, got nan",
        "TypeError: timeout_s must be a number of seconds, got None",
    ]


def test_every_call_after_close_is_refused_and_close_is_idempotent():
    (errors,) = run_ranks(shm_workers.closed_refuses_every_call, 1)
    closed = "RuntimeError: rank 0: the ODC transport is closed; make a new one to use it again"
    assert errors.pop("close") == ""
    assert errors == dict.fromkeys(errors, closed)


def test_a_rank_killed_inside_alloc_leaves_no_shm_file(tmp_path):
    import glob

    import pytest

    from odc_plugin.launch import RankFailed

    report = str(tmp_path / "prefix")
    with pytest.raises(RankFailed, match="time limit"):
        run_ranks(shm_workers.dies_in_alloc, 2, report, timeout_s=5)
    with open(report) as f:
        prefix = f.read()
    assert glob.glob(f"{prefix}*") == []  # run_ranks removed what its killed ranks left (remove_files_of)


def test_a_new_transport_removes_the_files_of_dead_creators():
    import os
    import subprocess
    import time

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"/dev/shm/odc-0123456789ab-odc.params-r3-p{dead.pid}"
    live = f"/dev/shm/odc-0123456789ab-odc.params-r2-p{os.getpid()}"  # a rank still setting it up
    fresh = f"/dev/shm/odc-0123456789ab-odc.params-r1-p{dead.pid}"  # maybe a live job's in another pid namespace
    for path in (stale, live, fresh):
        with open(path, "wb") as f:
            f.write(b"x")
    hours_ago = time.time() - 2 * 3600
    for path in (stale, live):
        os.utime(path, (hours_ago, hours_ago))
    try:
        run_ranks(shm_workers.transport_prefix, 1)
        assert not os.path.exists(stale)
        assert os.path.exists(live) and os.path.exists(fresh)
    finally:
        for path in (stale, live, fresh):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("method", ["direct", "slots"])
def test_adds_right_after_a_barrier_are_not_lost_and_the_method_is_fixed_while_an_accumulator_exists(method):
    world, rounds = 3, 6
    results = run_ranks(shm_workers.accumulate_between_barriers, world, rounds, method)
    # after barrier r every owner holds the sum over rounds <= r of the sum over senders of (sender + 1 + round)
    want = [[float(sum(s + 1 + q for q in range(r + 1) for s in range(world)))] for r in range(rounds)]
    for res in results:
        # Directly, peers that left a barrier add into the accumulator while its owner reads it (ODC orders
        # this with its published flag); with slots they add into their slots, which the owner folds at the
        # next barrier only: every barrier's sum is exact, none lost to a fold racing a sender.
        assert res["sums"] == want if method == "slots" else res["sums"][-1] == want[-1]
        # the slots: one more copy of the accumulator per peer
        assert res["bytes"] == 777 * 4 * (world if method == "slots" else 1)
        assert res["refused"].startswith("the accumulate method changes only while no accumulator exists")


def test_held_bytes_are_measured_from_the_mappings_a_freed_region_still_viewed_included():
    page = 4096
    for figures in run_ranks(shm_workers.held_as_mapped, 2):
        # the control words (doorbell, arrivals, failure notices) take a page each, counted on request only
        assert figures["none"] == 0 and figures["control"] == 3 * page
        assert figures["built"] == figures["freed, viewed"] == 3 * page  # 12,000 bytes in 3 pages
        assert figures["let go"] == 0
