"""The shared-memory transport with real processes."""

import torch

from odc_plugin.comm import make_transport
from odc_plugin.launch import run_ranks

from . import shm_workers, transport_workers


def test_concurrent_accumulates_lose_nothing_and_gets_read_peers():
    world, rounds = 3, 200
    results = run_ranks(shm_workers.concurrent_accumulate, world, rounds)
    expected = rounds * sum(r + 1 for r in range(world))
    for rank, res in enumerate(results):
        assert torch.equal(res["acc"], torch.full((1000,), float(expected))), rank
        for peer, got in enumerate(res["pulled"]):
            assert torch.equal(got, torch.arange(8, 24, dtype=torch.uint8) + peer)


def test_barrier_timeout_names_the_missing_rank():
    results = run_ranks(transport_workers.late_rank, 3, "shm", 2)
    for rank in (0, 1):
        assert results[rank] == f"rank {rank}: ODC barrier #1 timed out after 1s; rank(s) [2] did not arrive"


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
    from odc_plugin.comm.base import ROUND_SHIFT

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


def test_freeing_a_region_still_viewed_is_refused_and_changes_nothing():
    world = 2
    results = run_ranks(shm_workers.free_refused_while_viewed, world)
    for rank, res in enumerate(results):
        assert res["refused"] == (
            f"rank {rank}: shared-memory region 'r' cannot be freed: a tensor still views 1 of its mappings; "
            "drop every view of a region before freeing it"
        )
        # the region kept its contents and every rank's mapping: the refused free's peers still add and read
        assert [p.tolist() for p in res["pulled"]] == [[peer + 1 + 10.0] * 8 for peer in range(world)], rank
        mapped, after_refusal, freed = res["mapped"]
        assert after_refusal == mapped and freed == mapped - (world - 1) * 32, rank
        assert res["again"] == 0, rank
