"""The store barrier across ranks that share no transport (as ranks on different nodes), with real processes."""

import re

from odc_plugin.launch import run_ranks

from . import store_barrier_workers


def test_missing_rank_is_named_and_a_late_arrival_fails_too():
    results, stores = zip(*run_ranks(store_barrier_workers.rounds_then_late_rank, 3, 5, 2))
    assert set(stores) == {"TCPStore"}  # a client of the job's store at MASTER_ADDR, by public API
    decided = "ODC barrier #6 timed out after 1s; rank(s) [2] did not arrive"
    # whichever rank gave up first decided the outcome; every rank reports that same decision
    deciders = [r for r in (0, 1) if results[r] == f"rank {r}: {decided}"]
    assert len(deciders) == 1, results
    for rank, message in enumerate(results):
        if rank not in deciders:
            assert re.fullmatch(
                rf"rank {rank}: ODC barrier #6 failed: rank {deciders[0]}: {re.escape(decided)}", message
            ), message
