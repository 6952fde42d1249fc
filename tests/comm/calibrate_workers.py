"""Per-rank bodies of the calibration tests (tests/comm/test_calibrate.py)."""

from __future__ import annotations

import time

import torch

from odc_plugin.comm import DelegatingTransport, make_transport
from odc_plugin.comm.calibrate import Bucket, calibrate, calibrate_all_to_all


class SlowGets(DelegatingTransport):
    """A transport whose gets take `delay_s` longer: a slow link."""

    def __init__(self, inner, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s

    def get(self, region, peer, offset, out):
        time.sleep(self.delay_s)
        super().get(region, peer, offset, out)


def calibrated(rank, world_size, methods=None, slots_budget_bytes=None, delay_s=0.0):
    """Calibrate a shm transport at two bucket sizes, then add into a fresh accumulator with the chosen method."""
    transport = make_transport("shm")
    if delay_s:
        transport = SlowGets(transport, delay_s)
    buckets = [Bucket(3000, 2), Bucket(50_000)]
    result = calibrate(transport, None, buckets, methods=methods, slots_budget_bytes=slots_budget_bytes, repeats=1)
    acc = transport.alloc("acc", 10, torch.float32)
    for peer in range(world_size):
        transport.accumulate(acc, peer, 0, torch.ones(10))
    transport.barrier(60)
    sums, nbytes = acc.local.tolist(), transport.region_bytes(acc)
    transport.close()
    return {"result": result, "sums": sums, "bytes": nbytes, "method": transport.accumulate_method}


def all_to_all(rank, world_size, group_sizes, message_bytes):
    """The all-to-all's calibration on this rank, over gloo on CPU."""
    return calibrate_all_to_all(None, group_sizes, message_bytes, device=torch.device("cpu"), repeats=3, iters=2)
