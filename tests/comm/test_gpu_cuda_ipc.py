"""cuda_ipc transport with real processes on the GPU(s) of one machine (all ranks share GPU 0 when there
is only one). Needs CUDA and Triton; skipped otherwise."""

import importlib.util

import pytest
import torch

from odc_plugin.launch import run_ranks

from . import transport_workers

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the `gpu` extra)"),
]


@pytest.mark.parametrize("method", ["direct", "slots"])
@pytest.mark.parametrize("world", [1, 3])
def test_conformance(world, method):
    """Gets, and adds from every rank into every owner at once, exact under both accumulate methods."""
    options = {"accumulate": method}
    for rank, res in enumerate(run_ranks(transport_workers.conformance, world, "cuda_ipc", options, timeout_s=300)):
        assert res == {"gets": True, "first": True, "second": True}, rank


def test_barrier_timeout_names_the_missing_rank():
    results = run_ranks(transport_workers.late_rank, 3, "cuda_ipc", 2, timeout_s=300)
    for rank in (0, 1):
        # barrier #1 is the transport's start-up check of peer atomics
        assert results[rank] == f"rank {rank}: ODC barrier #2 timed out after 1s; rank(s) [2] did not arrive"


@pytest.mark.parametrize("world", [2, 3])
def test_start_up_probe_of_peer_atomics_passes_and_its_time(world):
    """The transport's start-up check (every rank adds a pattern into every rank's memory with the real
    kernel; exact sums) passes on this machine's GPUs; its time at start is printed (run with -s)."""
    seconds = run_ranks(transport_workers.cuda_ipc_probe, world, timeout_s=300)
    print(f"peer-atomics probe, {world} ranks on {torch.cuda.device_count()} GPU(s): {max(seconds) * 1e3:.1f} ms")
    assert all(0 < s < 30 for s in seconds), seconds
