"""CUDA IPC transport: ranks on one node, each with its own GPU (or sharing one, as the tests do).

Every rank allocates each region on its GPU and exports it with torch's own CUDA IPC support (the
mechanism torch.multiprocessing uses); the handles go round once, at `alloc`, through the process group.
Each rank maps every peer's region *on its own device*: the mapping is a tensor on this rank's GPU whose
memory lives on the peer's GPU, reached over NVLink/P2P. So `get` is a plain device copy and
`accumulate` a Triton kernel, both enqueued on the caller's current stream: under "direct" it adds with
system-scope atomics straight into the owner's fp32 accumulator and the owner does nothing; under
"slots" (slots.py) it adds without atomics into the sender's own slot in the owner's memory, and the
owner folds its slots at the barrier.

The barrier pushes: each rank writes its epoch into its own slot of every peer's arrival array (a
release store at system scope, after the whole device is synchronized) and then polls its own array.

Ordering, and why it holds without luck:
- publish -> get: the owner's shard copy completes (host synchronize in `signal`) before its flag is
  even written; a reader issues its gets only after its host saw the flag. Each get is a fresh copy
  reading the owner's memory over P2P, so it cannot hit stale lines cached on the reader's side.
- accumulate -> barrier: a rank's adds are device-complete (host synchronize) before its arrival flags
  are released; the owner leaves the barrier only after seeing every flag, so kernels it launches
  afterwards (reading its accumulator) start after every peer's adds were performed in its memory.
- concurrent writers: adds into one word from several GPUs are atomic at system scope; no locks. Under
  "slots" every word has one writer; the fold runs after the barrier's meeting (every sender's adds are
  device-complete before its arrival), and a second meeting follows it before any sender adds again.
- failure notices (base.py) are a region like any other: a rank posts its own with a local store
  after a device synchronize, peers read them with `get` in their waits.

Memory. Each region is allocated in a private memory pool of its own, in a segment cudaMalloc made:
torch shares expandable segments only through pidfd_getfd, which unprivileged containers refuse, and
verl turns expandable segments on after each weight sync, so when the allocation lands in one it is made
again with them off for that allocation alone. Each peer gets its own export of the region (torch counts
the processes still mapping an export, and frees the memory once all of them let go); `free` drops
every mapping, meets the peers, then drops the region, so its block is freed at once and its pool's
segment goes back to the device at the next `torch.cuda.empty_cache()` (verl's, after it offloads).

Needs: Triton (the `gpu` extra), every rank on one node, peer access between the GPUs, with native P2P
atomics (NVLink) for "direct" when ranks are on different GPUs, and no expandable_segments in torch's
allocator (checked when the transport starts: cuda_ipc_setup.py, and peer_atomics.py, which runs the real
kernel and checks the sums; where the atomics fail that check, "auto" takes "slots" and checks those
instead; a peer's GPU need not be visible to a rank's process). Verified only on a GPU
machine (tests/comm/test_gpu_cuda_ipc.py, ranks sharing one GPU; never across separate GPUs); nothing
here runs on CPU.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from . import peer_atomics
from .base import ACCUMULATE_METHODS, SETUP_TIMEOUT_S, Region, Transport
from .cuda_ipc_setup import ProcessGpus, first_line, open_error, setup_error

_BARRIER = "odc.barrier"


class CudaIpcTransport(Transport):
    name = "cuda_ipc"

    def __init__(self, group: dist.ProcessGroup | None = None, accumulate: str = "auto"):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc transport needs CUDA; on CPU use 'shm'")
        # Triton is imported here, not at the top, so that the package imports without it.
        from . import kernels

        self._kernels = kernels
        self.group = group
        self.device = torch.device("cuda", torch.cuda.current_device())
        # Every rank's report, so that every rank decides the same (cuda_ipc_setup.py).
        self._gpus: list = [None] * self.world_size
        dist.all_gather_object(self._gpus, ProcessGpus.here(self.device.index), group=group)
        error = setup_error(self._gpus)
        if error:
            raise RuntimeError(error)
        self._own: dict[str, torch.Tensor] = {}
        self._pools: dict[str, torch.cuda.MemPool] = {}
        self._bytes: dict[str, int] = {}  # each region's private pool's segments, as the driver holds them
        self._freed_pools: list = []  # ids of freed regions' pools: their memory stays while a tensor views it
        self._peers: dict[str, list[torch.Tensor]] = {}
        self._barrier_stream = torch.cuda.Stream(self.device)
        self._arrivals = self._alloc_control(_BARRIER, self.world_size, torch.int64)
        self._arrivals_host = torch.zeros(self.world_size, dtype=torch.int64, pin_memory=True)
        self._alloc_failure_notices()
        # Adds into another GPU's memory are exact only with native peer atomics: checked, not trusted; where
        # they fail, "auto" takes the slots, which need none, and checks those.
        mine = self._gpus[self.rank].visible
        devices = [mine.index(g.gpu) if g.gpu in mine else None for g in self._gpus]
        self.probe_fallback: str | None = None  # why "auto" fell back to slots
        self.set_accumulate_method("slots" if accumulate == "slots" else "direct")
        try:
            self.probe_s = peer_atomics.check(self, [g.gpu for g in self._gpus], devices, group)
        except peer_atomics.PeerAddsError as e:  # every rank raises it alike, from every rank's findings
            if accumulate != "auto":
                raise
            self.probe_fallback = str(e)
            self.set_accumulate_method("slots")
            self.probe_s = peer_atomics.check(self, [g.gpu for g in self._gpus], devices, group)

    def accumulate_methods(self) -> tuple[str, ...]:
        return ("slots",) if self.probe_fallback else ACCUMULATE_METHODS

    def alloc(self, name: str, numel: int, dtype: torch.dtype, timeout_s: float = SETUP_TIMEOUT_S) -> Region:
        self._check_alloc(name, numel, dtype, self._peers, timeout_s)
        total = self._allocated_numel(name, numel, dtype)
        own, pool = _shareable_zeros(total, dtype, self.device)
        nbytes = _pool_bytes(pool.id)
        # The zeros must be in memory before any peer can write into the region; the collective below
        # only starts once this has returned.
        torch.cuda.synchronize(self.device)
        # A rank whose allocation raised joins no collective: its peers wait for it where its notice ends
        # the wait. From here on a rank's failure is data the collectives carry to every rank.
        self._setup_meeting(name, timeout_s)
        try:
            # one export per peer: each carries the count that peer's mapping holds (see the module)
            exports = [None if r == self.rank else reduce_tensor(own)[1] for r in range(self.world_size)]
        except RuntimeError as e:  # a rank that cannot export still takes part, so no peer waits for it
            exports = f"cuda_ipc: rank {self.rank} cannot share its region '{name}' ({first_line(str(e))})"
        exported: list = [None] * self.world_size
        dist.all_gather_object(exported, exports, group=self.group)
        self._raise_first_error(exported)
        peers, error = [], None
        for r in range(self.world_size):
            try:
                peers.append(own if r == self.rank else self._open(exported[r][self.rank]))
            except RuntimeError as e:
                error = open_error(self._gpus, self.rank, r, name, str(e))
                break
        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        self._raise_first_error(errors)
        self._own[name], self._pools[name], self._bytes[name] = own, pool, nbytes
        self._peers[name] = [t[:total] for t in peers]
        self._allocated(name, numel, dtype, own[:total])
        return Region(name, numel, dtype, own[:numel])

    def free(self, name: str) -> None:
        self._check_free(name, self._peers)
        torch.cuda.synchronize(self.device)  # nothing enqueued may still read or write the region
        # Dropping the mappings closes the handles, and each drop tells its owner this rank let go.
        del self._peers[name]
        self._accumulators.pop(name, None)
        dist.barrier(group=self.group)
        # Every peer has let go: the block is freed now, not parked until a later torch.cuda.ipc_collect().
        del self._own[name], self._bytes[name]
        self._freed_pools.append(self._pools.pop(name).id)  # its segment goes back at the next empty_cache()

    def region_bytes(self, region: Region) -> int:
        self._check_open()
        return self._bytes[region.name]

    def held_bytes(self, control: bool = False) -> int:
        """The segments of this rank's regions' private pools as the allocator reserves them, and what tensors
        still use of freed regions' pools."""
        self._check_open()
        # a freed region's pool counts what a tensor still uses of it; its free segment goes at empty_cache()
        self._freed_pools = [pool for pool in self._freed_pools if _pool_bytes(pool, "allocated_size")]
        live = [pool.id for name, pool in self._pools.items() if control or name not in self._control_names]
        return sum(map(_pool_bytes, live)) + sum(_pool_bytes(pool, "allocated_size") for pool in self._freed_pools)

    def mapped_bytes(self) -> int:
        self._check_open()
        # each peer's slice was allocated as this rank's was, so it takes as many bytes
        return (self.world_size - 1) * sum(self._bytes.values())

    @staticmethod
    def _raise_first_error(gathered: list) -> None:
        # `gathered` came from every rank: all raise its first error, the same one, so that none is left
        # waiting in a later collective for a rank that failed.
        error = next((x for x in gathered if isinstance(x, str)), None)
        if error:
            raise RuntimeError(error)

    def _open(self, args) -> torch.Tensor:
        bound = inspect.signature(rebuild_cuda_tensor).bind(*args)
        # Map the peer's memory into *this* rank's device, also when the peer's GPU is not visible to this
        # process (CUDA opens such handles): kernels launched here address it directly, and no CUDA
        # context is created on the peer's GPU in this process.
        bound.arguments["storage_device"] = self.device.index
        # The producer synchronized before exporting, so there is nothing to wait for.
        bound.arguments["event_sync_required"] = False
        return rebuild_cuda_tensor(*bound.args)

    def peer_tensor(self, region: Region, peer: int) -> torch.Tensor:
        """`peer`'s slice of `region`, mapped on this rank's device: kernels launched here read and write
        it directly (benchmarks/bench_transport_gpu.py measures other accumulate designs through it)."""
        self._check_range(region, peer, 0, 0)
        return self._peers[region.name][peer]

    def get(self, region: Region, peer: int, offset: int, out: torch.Tensor) -> None:
        n = self._check_transfer(region, peer, offset, out, "out")
        # Same-device copy on the current stream: cudaMemcpyAsync reads the peer's GPU over P2P.
        out.view(-1).copy_(self._peers[region.name][peer][offset : offset + n])

    def accumulate(self, region: Region, peer: int, offset: int, src: torch.Tensor) -> None:
        n = self._check_transfer(region, peer, offset, src, "src")
        if region.dtype != torch.float32:
            raise TypeError(f"accumulate needs a float32 region, '{region.name}' is {region.dtype}")
        full = self._peers[region.name][peer]
        slot = self._slot(region, full, peer)
        if slot is not None:
            self._kernels.add(slot[offset : offset + n], src)  # no other writer: no atomics
            return
        # Each rank starts at its own tile of the range, so the owner's concurrent writers spread out.
        dst = full[offset : offset + n]
        self._kernels.accumulate(dst, src, scope="sys", sender=self.rank, senders=self.world_size)

    def barrier(self, timeout_s: float) -> None:
        self._meet(timeout_s)
        self._fold_slots(self._meet, timeout_s)

    def _meet(self, timeout_s: float) -> None:
        self._check_wait(timeout_s)
        epoch = self._next_epoch()
        # Host-synchronizing the device waits for every stream this rank enqueued gets and accumulates on
        # (FSDP's all-gather and reduce-scatter streams included), so every atomic add has been performed
        # in its owner's memory before the flag below is written.
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self._barrier_stream):
            for peer in range(self.world_size):
                # Release store at system scope: a peer that reads this epoch also sees every write above.
                self._kernels.store_release(self._peers[_BARRIER][peer][self.rank : self.rank + 1], epoch)

        def missing() -> list[int]:
            with torch.cuda.stream(self._barrier_stream):
                self._arrivals_host.copy_(self._arrivals.local, non_blocking=True)
            self._barrier_stream.synchronize()
            return [r for r in range(self.world_size) if not self.peer_arrived(r, int(self._arrivals_host[r]), epoch)]

        # Once none is missing, every peer's adds into this rank's memory completed before its flag was
        # released, and kernels launched from here on start after this host observation: they read final sums.
        self.wait_for_arrivals(missing, epoch, timeout_s)

    def synchronize(self) -> None:
        self._check_open()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._closed = True
        if self._peers:
            torch.cuda.synchronize(self.device)
        # Dropping the mappings closes the IPC handles (torch counts them for the exporting process).
        self._peers.clear()
        self._own.clear()
        self._pools.clear()
        self._bytes.clear()


def _pool_bytes(pool_id, size: str = "total_size") -> int:
    """Bytes of the segments a private pool holds (the driver's view: a small region takes a whole segment),
    or with size="allocated_size" what of them is in use."""
    return sum(segment[size] for segment in torch.cuda.memory_snapshot(pool_id))


def _expandable_segments_on(device: torch.device) -> bool:
    """Whether the caching allocator would put a large block (as a region is) in an expandable segment now:
    found by allocating one, 1 MiB, in a pool of its own (its 2 MiB segment goes back at empty_cache())."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device):
        probe = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    expandable = any(segment.get("is_expandable") for segment in torch.cuda.memory_snapshot(pool.id))
    del probe
    return expandable


def _shareable_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.cuda.MemPool]:
    """`numel` zeros that CUDA IPC can share, in a private pool of their own (freeing them frees the pool's
    whole segment): in a segment cudaMalloc made, not an expandable one. torch 2.11 cannot say whether
    expandable segments are on, and its private pools use them too; so a probe (1 MiB) finds out, and the
    region is allocated once, with them off for that one allocation where they were on. Should the probe
    be wrong, the region is allocated again with them off."""
    expandable = _expandable_segments_on(device)
    for off in (expandable, not expandable):
        pool = torch.cuda.MemPool()
        if off:
            torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
        try:
            with torch.cuda.use_mem_pool(pool, device):
                zeros = torch.zeros(numel, dtype=dtype, device=device)
        finally:
            if off:
                torch._C._accelerator_setAllocatorSettings("expandable_segments:True")  # on, as they were
        if not any(segment.get("is_expandable") for segment in torch.cuda.memory_snapshot(pool.id)):
            return zeros, pool
        del zeros
        if off:
            break
    raise RuntimeError(
        "cuda_ipc: torch put a region in an expandable segment with expandable_segments off; "
        "this torch version cannot share ODC's regions over CUDA IPC"
    )
