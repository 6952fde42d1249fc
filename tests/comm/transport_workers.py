"""Per-rank bodies of the transport tests (module-level so that spawned ranks can import them).

`conformance` runs the same checks for any GPU transport kind; the GPU tests call it for cuda_ipc
(several processes on one GPU, or one GPU each when there are several) and nvshmem (one PE, loopback).
`late_rank` serves every kind, shm included.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from odc_plugin.comm import ODCTimeoutError, make_transport

N = 1 << 16  # accumulator elements
ROUNDS = 20


def make_on_cpu(rank, world_size):
    out = {"auto": type(make_transport("auto")).__name__}
    for kind, opts in (("cuda_ipc", {}), ("nvshmem", {}), ("shm_options", {"staging": None})):
        try:
            make_transport(kind.split("_options")[0], **opts)
            out[kind] = "no error"
        except (RuntimeError, TypeError) as e:
            out[kind] = f"{type(e).__name__}: {e}"
    return out


def nvshmem_on_nodes(rank, world_size, hosts):
    """make_transport("nvshmem") with rank r pretending to run on node hosts[r] (nodes simulated on one
    machine); returns the error it raised."""
    socket.gethostname = lambda: hosts[rank]
    try:
        make_transport("nvshmem")
    except RuntimeError as e:
        return str(e)
    return "no error"


def _use_gpu(rank):
    torch.cuda.set_device(rank % torch.cuda.device_count())


def _single_node_nvshmem_env():
    # One node: no network transport, bootstrap over loopback.
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")


def conformance(rank, world_size, kind, options):
    _use_gpu(rank)
    if kind == "nvshmem":
        _single_node_nvshmem_env()
    t = make_transport(kind, **options)
    dev = torch.device("cuda", torch.cuda.current_device())
    params = t.alloc("params", 4096 + 13, torch.uint8)
    acc = t.alloc("acc", N, torch.float32)
    acc2 = t.alloc("acc2", 100, torch.float32)  # a second accumulator: slots name their region
    flag = t.alloc("flag", 1, torch.int64)

    def pattern(r):
        return ((torch.arange(params.numel, device=dev) + 7 * r) % 251).to(torch.uint8)

    params.local.copy_(pattern(rank))
    t.signal(flag, 0, 1)

    # Gets on a side stream, as from FSDP's all-gather stream.
    ag = torch.cuda.Stream(dev)
    pulled = []
    with torch.cuda.stream(ag):
        for k in range(world_size):
            peer = (rank + k) % world_size
            t.wait_at_least(flag, peer, 0, 1, 60.0, "publish")
            out = torch.empty(4000, dtype=torch.uint8, device=dev)
            t.get(params, peer, 13, out)
            pulled.append((peer, out))
    ag.synchronize()
    gets_ok = all(torch.equal(out.cpu(), pattern(peer)[13:4013].cpu()) for peer, out in pulled)

    # Every rank adds into every owner at once (so each owner has world_size concurrent writers), in
    # fp32 over the whole region and in bf16 at an offset, on a side stream as FSDP's reduce-scatter.
    rs = torch.cuda.Stream(dev)
    ones = torch.ones(N, device=dev)
    # `ones` is filled on the default stream: the side stream must not read it before (a GPU run of 3 ranks
    # once summed short on one rank without this wait)
    rs.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(rs):
        for _ in range(ROUNDS):
            for k in range(world_size):
                peer = (rank + k) % world_size
                t.accumulate(acc, peer, 0, ones * (rank + 1))
                t.accumulate(acc, peer, 5, (ones[5:] * (rank + 1)).to(torch.bfloat16))
                t.accumulate(acc2, peer, 10, ones[:50])
    t.barrier(60.0)  # no explicit synchronize: the barrier must make every accumulate visible
    total = ROUNDS * sum(r + 1 for r in range(world_size))
    want = torch.full((N,), 2.0 * total)
    want[:5] = total
    want2 = torch.zeros(100)
    want2[10:60] = ROUNDS * world_size
    first = torch.equal(acc.local.cpu(), want) and torch.equal(acc2.local.cpu(), want2)

    # A second mini-batch, as the FSDP layer runs it: zero, publish, peers wait for the flag, add, meet.
    acc.local.zero_()
    t.signal(flag, 0, 2)
    with torch.cuda.stream(rs):
        for k in range(world_size):
            peer = (rank + k) % world_size
            t.wait_at_least(flag, peer, 0, 2, 60.0, "second publish")
            t.accumulate(acc, peer, 0, ones[:1000] * (rank + 1))
    t.barrier(60.0)
    second = (
        acc.local[:1000].cpu().eq(sum(r + 1 for r in range(world_size))).all().item()
        and acc.local[1000:].cpu().eq(0).all().item()
    )
    t.close()
    return {"gets": gets_ok, "first": first, "second": second}


def late_rank(rank, world_size, kind, late, late_by_s=None):
    """The other ranks wait 1 s at a barrier for rank `late`, which skips it (`late_by_s` None) or
    reaches it `late_by_s` seconds after them. Returns each rank's error message, or "no error"."""
    if kind != "shm":
        _use_gpu(rank)
    t = make_transport(kind)
    if rank == late:
        if late_by_s is None:
            return "skipped the barrier"
        time.sleep(late_by_s)
    try:
        t.barrier(1.0)
    except ODCTimeoutError as e:
        return str(e)
    return "no error"


def heap_too_small(rank, world_size):
    _use_gpu(rank)
    _single_node_nvshmem_env()
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = "256M"
    t = make_transport("nvshmem")
    try:
        t.alloc("odc.grads", 512 << 20, torch.uint8)
    except RuntimeError as e:
        return str(e)
    finally:
        t.close()
    return "no error"


def nvshmem_held_after_free(rank, world_size):
    """What the nvshmem transport says it holds with a 64 MiB region, and after freeing it."""
    _use_gpu(rank)
    _single_node_nvshmem_env()
    t = make_transport("nvshmem")
    try:
        t.alloc("odc.params", 64 << 20, torch.uint8)
        built = t.held_bytes()
        t.free("odc.params")
        return built, t.held_bytes()
    finally:
        t.close()


def peer_atomics_check(rank, world_size, lossy_pair, method="direct"):
    """The start-up check of peer atomics over shm with accumulate `method`, every add exact, or, with
    `lossy_pair` = (sender, owner), over a shm transport whose adds from `sender` into `owner` lose the first
    element's update (a GPU pair without native peer atomics). Returns what `check` raised on this rank, or
    "passed"."""
    from odc_plugin.comm import peer_atomics
    from odc_plugin.comm.shm import ShmTransport

    class LosesUpdates(ShmTransport):
        def accumulate(self, region, peer, offset, src):
            if (self.rank, peer) == lossy_pair and region.name == "odc.probe":
                src = src.clone()
                src[0] = 0.0
            super().accumulate(region, peer, offset, src)

    transport = LosesUpdates()
    transport.set_accumulate_method(method)
    gpus = [f"GPU-{r}" for r in range(world_size)]
    try:
        peer_atomics.check(transport, gpus, [None] * world_size)
    except RuntimeError as e:
        return str(e)
    return "passed"


def cuda_ipc_probe(rank, world_size):
    """make_transport("cuda_ipc") on this rank's GPU: its start-up check of peer atomics passed; its time."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    transport = make_transport("cuda_ipc")
    seconds = transport.probe_s
    transport.close()
    return seconds
