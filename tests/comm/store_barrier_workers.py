"""Per-rank bodies of the store-barrier tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import time

import torch.distributed as dist

from odc_plugin.comm import ODCTimeoutError
from odc_plugin.comm.store_barrier import StoreBarrier


def rounds_then_late_rank(rank, world_size, rounds, late):
    """`rounds` barriers every rank reaches, then one that `late` reaches 2 s after the 1 s timeout."""
    barrier = StoreBarrier(range(world_size), dist.get_rank(), "test")
    for _ in range(rounds):
        barrier.wait(10.0)
    if rank == late:
        time.sleep(2.0)
    try:
        barrier.wait(1.0)
        outcome = "passed"
    except ODCTimeoutError as e:
        outcome = str(e)
    if rank == 0:
        time.sleep(3.0)  # rank 0 hosts the store: it stays until the late rank has read the outcome
    return outcome, type(barrier.store).__name__
