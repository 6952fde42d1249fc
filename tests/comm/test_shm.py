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
