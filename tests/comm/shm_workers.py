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


def failure_rounds(rank, world_size):
    """Round 0: ranks 0 and 2 wait at a barrier that rank 1 never reaches: it adds into rank 0, then
    announces a failure. Everyone recovers. Round 1: a barrier passes (the round-0 notice is not raised
    again, though ranks 0 and 2 counted one barrier more than rank 1); ranks 2 then 0 fail while rank 1
    waits; everyone recovers. Round 2: a barrier passes. Returns what each rank saw."""
    import time

    from odc_plugin.comm import ODCPeerFailedError

    t = make_transport("shm")
    acc = t.alloc("acc", 4, torch.float32)
    t.barrier(30)
    seen = {}

    def wait_at_barrier():
        start = time.monotonic()
        try:
            t.barrier(600)
            return "passed", time.monotonic() - start
        except ODCPeerFailedError as e:
            return str(e), time.monotonic() - start

    if rank == 1:
        time.sleep(0.2)
        t.accumulate(acc, 0, 0, torch.ones(4))  # in flight when it fails: rank 0 must see it after recovery
        t.announce_failure("RuntimeError: first")
    else:
        seen["round 0"] = wait_at_barrier()
    seen["notices 0"] = [(n.rank, n.message) for n in t.recover(30)]
    seen["accumulator"] = acc.local.tolist()
    t.barrier(30)
    if rank == 1:
        seen["round 1"] = wait_at_barrier()
    else:
        time.sleep(0.2 if rank == 2 else 0.4)
        t.announce_failure(f"ValueError: from rank {rank}")
    seen["notices 1"] = sorted((n.rank, n.message) for n in t.recover(30))
    t.barrier(30)
    seen["round 2"] = "passed"
    t.close()
    return seen


def free_refused_while_viewed(rank, world_size):
    """free() of a region whose `local` is still held is refused and changes nothing; once dropped, it frees."""
    t = make_transport("shm")
    region = t.alloc("r", 8, torch.float32)
    region.local.fill_(rank + 1)
    mapped = t.mapped_bytes()
    t.barrier(30)
    try:
        t.free("r")
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    t.accumulate(region, (rank + 1) % world_size, 0, torch.full((8,), 10.0))
    t.barrier(30)
    pulled = []
    for peer in range(world_size):
        out = torch.empty(8)
        t.get(region, peer, 0, out)
        pulled.append(out)
    after_refusal = t.mapped_bytes()
    t.barrier(30)
    del region
    t.free("r")
    freed = t.mapped_bytes()
    again = t.alloc("r", 4, torch.float32)  # the name is free again
    out = {"refused": refused, "pulled": pulled, "mapped": (mapped, after_refusal, freed), "again": again.local.sum()}
    del again
    t.close()
    return out
