"""How a mini-batch's time splits into compute, communication and waiting."""

from __future__ import annotations

import pytest

from odc_plugin.demo.timeline import BARRIER, COLLECTIVE, PUBLISHED, TRANSFER, breakdown


def test_a_collective_is_transfer_for_the_last_to_arrive_and_waiting_for_the_others():
    # two all-gathers: rank 0 arrives late to the first (0.1 s inside it), rank 1 to the second
    rank0 = [(1.0, 1.1, COLLECTIVE), (2.0, 2.5, COLLECTIVE)]
    rank1 = [(0.2, 1.1, COLLECTIVE), (2.4, 2.5, COLLECTIVE)]
    parts = breakdown(3.0, [3.0, 2.8], [rank0, rank1])
    assert parts[0]["comm_s"] == pytest.approx(0.2) and parts[0]["wait_s"] == pytest.approx(0.4)
    # rank 1 also waited the 0.2 s between finishing its own work and the end of the mini-batch
    assert parts[1]["comm_s"] == pytest.approx(0.2) and parts[1]["wait_s"] == pytest.approx(0.8 + 0.2)
    assert [p["compute_s"] for p in parts] == pytest.approx([2.4, 1.8])


def test_one_sided_calls_are_transfer_and_waits_for_peers_or_barriers_are_waiting():
    (part,) = breakdown(
        2.0, [2.0], [[(0.0, 0.1, TRANSFER), (0.5, 0.8, PUBLISHED), (1.0, 1.5, BARRIER), (1.6, 1.7, TRANSFER)]]
    )
    assert part == pytest.approx({"compute_s": 1.0, "comm_s": 0.2, "wait_s": 0.8, "barriers": 1})


def test_ranks_out_of_step_on_collectives_are_an_error():
    with pytest.raises(ValueError, match="different numbers of collectives"):
        breakdown(1.0, [1.0, 1.0], [[(0, 0.1, COLLECTIVE)], []])


def _announce_through_the_timed_transport(rank, world_size):
    """Rank 1 announces a failure through the demo's timed transport while its peers wait at a barrier
    (timeout 600 s); then every rank recovers through it and meets again."""
    from odc_plugin.comm import ODCPeerFailedError, make_transport
    from odc_plugin.demo.timeline import CommClock, TimedTransport

    clock = CommClock()
    transport = TimedTransport(make_transport("shm"), clock)
    seen = None
    if rank == 1:
        transport.announce_failure("RuntimeError: timed")
    else:
        try:
            transport.barrier(600)
        except ODCPeerFailedError as e:
            seen = str(e)
    notices = [(n.rank, n.message) for n in transport.recover(30)]
    transport.barrier(30)
    transport.close()
    return seen, notices, [kind for _, _, kind in clock.intervals]


def test_the_timed_transport_passes_failure_notices_and_recovery_through():
    from odc_plugin.launch import run_ranks

    results = run_ranks(_announce_through_the_timed_transport, 3)
    for rank, (seen, notices, kinds) in enumerate(results):
        if rank != 1:
            assert seen == f"rank {rank}: rank 1 failed in its mini-batch: RuntimeError: timed", seen
        assert notices == [(1, "RuntimeError: timed")], notices
        assert kinds == [BARRIER] * (2 if rank == 1 else 3), kinds  # the recovery meeting is time spent waiting
