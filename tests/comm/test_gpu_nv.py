"""nvshmem transport. With one PE, `loopback=True` sends the rank's own gets and accumulates through
NVSHMEM (bounce buffer, staging slots, put-with-signal, folds, credits, the barrier's counts). Tiny slots
force chunking and waits for credit. Needs CUDA, Triton and nvshmem4py; skipped otherwise."""

import importlib.util

import pytest
import torch

from odc_plugin.comm.nvshmem_staging import StagingConfig
from odc_plugin.launch import run_ranks

from . import transport_workers

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the `gpu` extra)"),
    pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None, reason="needs nvshmem4py (the `gpu` extra)"),
]


@pytest.mark.parametrize(
    "staging",
    [StagingConfig(slot_bytes=4096, slots=2), StagingConfig(slot_bytes=1 << 20, slots=1)],
    ids=["tiny-slots", "one-slot"],
)
def test_conformance_one_pe_loopback(staging):
    (res,) = run_ranks(
        transport_workers.conformance, 1, "nvshmem", {"loopback": True, "staging": staging}, timeout_s=300
    )
    assert res == {"gets": True, "first": True, "second": True}


def test_conformance_one_pe_direct():
    (res,) = run_ranks(transport_workers.conformance, 1, "nvshmem", {}, timeout_s=300)
    assert res == {"gets": True, "first": True, "second": True}


def test_heap_too_small_names_the_size_needed():
    (msg,) = run_ranks(transport_workers.heap_too_small, 1, timeout_s=300)
    assert "NVSHMEM symmetric heap too small for region 'odc.grads'" in msg
    assert "NVSHMEM_SYMMETRIC_SIZE=1G" in msg


def test_a_freed_region_still_counts_while_nvshmem_keeps_its_heap():
    """NVSHMEM keeps the device memory of its heap until finalize, so a region freed between phases is
    still held: what odc/held_outside_bytes reports on nvshmem."""
    ((built, freed),) = run_ranks(transport_workers.nvshmem_held_after_free, 1, timeout_s=300)
    assert built >= 64 << 20 and freed == built


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="several PEs need one GPU each")
def test_conformance_several_pes():
    world = min(3, torch.cuda.device_count())
    for rank, res in enumerate(
        run_ranks(
            transport_workers.conformance,
            world,
            "nvshmem",
            {"staging": StagingConfig(slot_bytes=1 << 16, slots=2)},
            timeout_s=300,
        )
    ):
        assert res == {"gets": True, "first": True, "second": True}, rank
