"""Per-rank bodies of the shared-memory transport tests."""

from __future__ import annotations

import torch

from odc_plugin.comm import make_transport


def concurrent_accumulate(rank, world_size, rounds, method="direct"):
    """Every rank adds into every owner's region many times at once; nothing may be lost."""
    t = make_transport("shm", accumulate=method)
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


def _error(call) -> str:
    """What `call()` raised, as "Type: message" ("" if nothing)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares the type and message
        return f"{type(e).__name__}: {e}"
    return ""


def misuse_changes_nothing(rank, world_size):
    """Every refused call of alloc, free, barrier, recover, wait_at_least, get and accumulate; then the
    same names, barriers and regions work as if the refused calls never happened."""
    t = make_transport("shm")
    out = {}
    out["alloc"] = [
        _error(lambda a=args: t.alloc(*a))
        for args in (
            ("r", 0, torch.float32),
            ("r", -1, torch.float32),
            ("r", True, torch.float32),
            ("r", 2.0, torch.float32),
            ("r", 4, "float32"),
            ("", 4, torch.float32),
            ("a/b", 4, torch.float32),
            ("a\0b", 4, torch.float32),
            ("odc.barrier", 4, torch.float32),
        )
    ]
    region = t.alloc("r", 4, torch.float32)  # the name the refused calls used is free
    out["again"] = _error(lambda: t.alloc("r", 4, torch.float32))
    out["free"] = [_error(lambda n=n: t.free(n)) for n in ("nope", "odc.failure")]
    # Rank 1 misuses every wait first; if a refused barrier had arrived, rank 0 would pass barrier #1 alone
    # and the ranks' epochs would differ from then on (the next barrier times out).
    if rank == 1:
        out["waits"] = [
            _error(lambda v=v: t.barrier(v)) for v in (None, float("nan"), float("inf"), 0, -1.0, True, "5")
        ] + [_error(lambda: t.recover(float("nan"))), _error(lambda: t.wait_at_least(region, 0, 0, 1, None, "x"))]
    region.local.copy_(torch.arange(4.0) + 10 * rank)
    t.barrier(30)
    peer = (rank + 1) % world_size
    out["transfers"] = [
        _error(lambda: t.get(region, peer, 0, torch.empty(4, dtype=torch.int64))),
        _error(lambda: t.accumulate(region, peer, 0, torch.ones(4, dtype=torch.float64))),
        _error(lambda: t.get(region, peer, 0, [0.0] * 4)),
        _error(lambda: t.accumulate(region, peer, 0, torch.ones(4, device="meta"))),
    ]
    t.accumulate(region, peer, 0, torch.ones(4, dtype=torch.bfloat16))  # bf16 into fp32: exact, taken
    t.barrier(5)
    out["epoch"] = t._epoch
    out["local"] = region.local.tolist()
    t.close()
    return out


def closed_refuses_every_call(rank, world_size):
    """Each call after close(), by name, and what it raised; close() again raises nothing."""
    t = make_transport("shm")
    region = t.alloc("r", 4, torch.float32)
    t.close()
    calls = {
        "alloc": lambda: t.alloc("x", 4, torch.float32),
        "free": lambda: t.free("r"),
        "get": lambda: t.get(region, 0, 0, torch.empty(4)),
        "accumulate": lambda: t.accumulate(region, 0, 0, torch.ones(4)),
        "barrier": lambda: t.barrier(1),
        "recover": lambda: t.recover(1),
        "wait_at_least": lambda: t.wait_at_least(region, 0, 0, 1, 1, "x"),
        "wait_until": lambda: t.wait_until(lambda: None, 1, lambda: ""),
        "signal": lambda: t.signal(region, 0, 1),
        "synchronize": t.synchronize,
        "announce_failure": lambda: t.announce_failure("x"),
        "failures": t.failures,
        "raise_if_a_peer_failed": t.raise_if_a_peer_failed,
        "region_bytes": lambda: t.region_bytes(region),
        "mapped_bytes": t.mapped_bytes,
        "control_bytes": t.control_bytes,
        "staging_bytes": t.staging_bytes,
        "close": t.close,
    }
    return {name: _error(call) for name, call in calls.items()}


def _mapping_of(address: int) -> str | None:
    """The /proc/self/maps line of the mapping that holds `address`, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return line.strip()
    return None


def free_while_viewed(rank, world_size):
    """free() of a region whose `local` is still held: the region is gone from the transport at once and
    its name free, the held view still reads its values, and the memory is unmapped once the view goes."""
    t = make_transport("shm")
    region = t.alloc("r", 8, torch.float32)
    region.local.fill_(rank + 1)
    mapped = t.mapped_bytes()
    t.barrier(30)
    held = region.local
    t.free("r")
    out = {"mapped": (mapped, t.mapped_bytes()), "held": held.tolist()}
    again = t.alloc("r", 4, torch.float32)
    t.accumulate(again, (rank + 1) % world_size, 0, torch.full((4,), 10.0))
    t.barrier(30)
    out["again"] = again.local.tolist()
    out["held after"] = held.tolist()  # the new region is other memory
    mapping = _mapping_of(held.data_ptr())
    out["path"] = mapping.split()[-2 if mapping.endswith("(deleted)") else -1]
    del held, region
    out["still mapped"] = mapping in open("/proc/self/maps").read()
    del again
    t.close()
    return out


def dies_in_alloc(rank, world_size, report):
    """Rank 0 creates its file of a region and waits inside alloc for rank 1, which never comes; the
    launcher's time limit kills both. `report`: a file rank 0 writes its file's name prefix to first."""
    import time

    t = make_transport("shm")
    if rank == 0:
        with open(report, "w") as f:
            f.write(t.path_prefix)
        t.alloc("big", 1 << 16, torch.float32)
    time.sleep(600)


def transport_prefix(rank, world_size):
    t = make_transport("shm")
    prefix = t.path_prefix
    t.close()
    return prefix


def accumulate_between_barriers(rank, world_size, rounds, method):
    """Every rank adds into every owner at once, then meets them, `rounds` times, adding again as soon as it
    leaves a barrier (as the lockstep baseline does); after every barrier each owner's accumulator holds
    every add so far. Returns the sums seen after each barrier, the region's bytes and what a change of
    method said while the accumulator existed."""
    t = make_transport("shm", accumulate=method)
    acc = t.alloc("acc", 777, torch.float32)
    sums = []
    for r in range(rounds):
        for k in range(world_size):
            t.accumulate(acc, (rank + k) % world_size, 0, torch.full((777,), float(rank + 1 + r)))
        t.barrier(60)
        sums.append(acc.local.unique().tolist())
    other = "direct" if method == "slots" else "slots"
    try:
        t.set_accumulate_method(other)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    nbytes = t.region_bytes(acc)
    del acc
    t.free("acc")
    t.set_accumulate_method(other)  # no accumulator left: allowed
    t.close()
    return {"sums": sums, "bytes": nbytes, "refused": refused}


def held_as_mapped(rank, world_size):
    """What held_bytes() measures (this rank's region files still mapped) as a region is built, freed while a
    view of it is still held, and let go; and the control words alone, on request."""
    t = make_transport("shm")
    figures = {"none": t.held_bytes(), "control": t.held_bytes(control=True)}
    region = t.alloc("r", 3000, torch.float32)
    figures["built"] = t.held_bytes()
    view = region.local[:10]
    del region
    t.free("r")
    figures["freed, viewed"] = t.held_bytes()
    del view
    figures["let go"] = t.held_bytes()
    t.close()
    return figures
