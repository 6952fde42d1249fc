"""Per-rank bodies of the shared-memory transport tests."""

from __future__ import annotations

import torch

from odc_plugin.comm import make_transport


def concurrent_accumulate(rank, world_size, rounds):
    """Every rank adds into every owner's region many times at once; nothing may be lost."""
    t = make_transport("shm")
    acc = t.alloc("acc", 1000, torch.float32)
    params = t.alloc("params", 64, torch.uint8)
    params.local.copy_(torch.arange(64, dtype=torch.uint8) + rank)
    t.barrier(30)
    pulled = [torch.empty(16, dtype=torch.uint8) for _ in range(world_size)]
    for peer in range(world_size):
        t.get(params, peer, 8, pulled[peer])
    ones = torch.ones(1000)
    for _ in range(rounds):
        for k in range(world_size):
            peer = (rank + k) % world_size
            t.accumulate(acc, peer, 0, ones * (rank + 1))
    t.barrier(30)
    out = {"acc": acc.local.clone(), "pulled": pulled}
    t.close()
    return out


def bad_ranges(rank, world_size):
    t = make_transport("shm")
    r = t.alloc("r", 10, torch.float32)
    errors = []
    for call in (lambda: t.get(r, 0, 8, torch.empty(4)), lambda: t.accumulate(r, world_size, 0, torch.ones(1))):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors
