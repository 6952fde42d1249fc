"""NVSHMEM transport (nvshmem4py): built for ranks across nodes, offered on one node only (a group
on several nodes is refused, select.flat_nvshmem_error: use HSDP there).

Regions live in NVSHMEM's symmetric heap, so a peer's slice is addressed by the same local address and
the peer's PE number. `get` is a host-initiated get on the current stream (through a symmetric bounce
buffer: over a network transport the local side of an RMA must be symmetric or registered).

`accumulate` cannot add remotely: NVSHMEM has no remote float atomics. It is split between sender and
owner instead:

- sender: packs a 64-byte header (where, how many, which dtype, which region) and the payload into a
  symmetric outbox and puts it, with signal, into its own staging slot in the owner's inbox. The owner's
  inbox holds `slots` slots per sending rank; slot `q % slots` carries the sender's q-th message and its
  signal word is set to q + 1. NVSHMEM delivers a put-with-signal's data before its signal.
- owner ("progress"): reads its signal words, and for every sender folds the slots that arrived, in
  sequence order, into the accumulator (atomic adds, on a private progress stream, each fold behind a
  stream wait on the slot's signal: that wait is NVSHMEM's acquire, so the kernel sees the payload).
  After the folds, a stream-ordered signal returns the slots to the sender (its credit word := number
  of slots folded); a sender reuses a slot only once the credit says the fold before it is done.
- progress runs whenever this rank calls the transport (get, accumulate, wait_at_least, barrier, and
  while any of them waits), so a sender that waits for credit keeps draining its own inbox and two
  ranks waiting on each other both move. Between calls nothing folds: an owner busy in pure compute
  delays its senders, it cannot deadlock them (it calls the barrier at the latest).
- publish -> get: the owner's shard copy is complete (host synchronize in `signal`) before its flag is
  written, and a reader's gets are issued after its host read the flag; a get reads owner memory.
- barrier: synchronize the device, quiet (every slot and signal this rank put is delivered), then tell
  every owner, with one put-with-signal, how many slots it was sent in all (signal = epoch). An owner
  leaves the barrier only after every rank arrived and it folded exactly that many slots from each, so
  after the barrier every accumulate is in the owner's accumulator.
- failure notices (base.py): a symmetric region like any other, posted by a local store and read with
  `get` (which also folds). The recovery meeting after a failure is a barrier, so it also waits until
  every slot sent in the failed round is folded before any rank resets its accumulator.

The staging (inbox, outbox, get bounce buffer) exists only while a region other than the failure
notices does: it is allocated with the first such region and freed with the last (`free`, collective like
nvshmem_free), so a transport whose regions are all released holds only its control words (signals,
credits, arrivals, the notices, and a small bounce buffer the notices are read through).

The symmetric heap must hold the regions plus the staging: NVSHMEM_SYMMETRIC_SIZE (read by NVSHMEM at
start-up) must be set before the process starts; `heap_bytes_needed` says how much, and running out is
reported with that number before NVSHMEM is asked. Everything that needs nvshmem4py, Triton or a GPU is
verified only on a GPU machine (tests/comm/test_gpu_nv.py: one PE, and several PEs on a multi-GPU machine); the
sizing, configuration and slot packing (nvshmem_staging.py) are pure and unit-tested on CPU.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from .base import SETUP_TIMEOUT_S, Region, Transport, poll
from .failure import NOTICE_WORDS
from .nvshmem_staging import (
    HEADER_BYTES,
    HEAP_RESERVE,
    StagingConfig,
    aligned,
    control_words,
    heap_bytes_available,
    heap_too_small_message,
    pack_slot,
    payload_dtype,
    staging_bytes,
)
from .select import flat_nvshmem_error


def _import_nvshmem():
    try:
        import nvshmem.core as nvshmem_core
        from cuda.core import Buffer, Device
    except ImportError as e:
        raise ImportError(
            "the nvshmem transport needs nvshmem4py; install the plugin's `gpu` extra "
            "(pip install 'odc-verl[gpu]', which pulls nvshmem4py-cu13)"
        ) from e
    return nvshmem_core, Buffer, Device


# NVSHMEM is initialised once per process; transports over the same group share it.
_RUNTIME: dict = {"refs": 0, "ranks": None}


def _acquire_runtime(nv, Device, group, rank: int, world_size: int, device_index: int) -> None:
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if _RUNTIME["refs"]:
        if _RUNTIME["ranks"] != ranks:
            raise RuntimeError(
                f"NVSHMEM is already running in this process over ranks {_RUNTIME['ranks']}; "
                f"it cannot also run over {ranks} (one NVSHMEM job per process)"
            )
        _RUNTIME["refs"] += 1
        return
    import numpy as np

    uid = nv.get_unique_id(empty=rank != 0)
    box = [uid._data.tobytes() if rank == 0 else None]
    dist.broadcast_object_list(box, src=ranks[0], group=group)
    if rank != 0:
        np.copyto(uid._data.view(np.uint8), np.frombuffer(box[0], dtype=np.uint8))
    device = Device(device_index)
    device.set_current()
    nv.init(device=device, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
    _RUNTIME.update(refs=1, ranks=ranks)


def _release_runtime(nv) -> None:
    _RUNTIME["refs"] -= 1
    if _RUNTIME["refs"] == 0:
        nv.finalize()
        _RUNTIME["ranks"] = None


class NvshmemTransport(Transport):
    name = "nvshmem"

    """`loopback=True` sends this rank's own gets and accumulates through NVSHMEM as if it were a peer
    (bounce buffer, staging, signals, folds, credits): how one PE tests the remote paths."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        staging: StagingConfig | None = None,
        loopback: bool = False,
        stall_timeout_s: float = 600.0,
    ):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        hosts: list = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        error = flat_nvshmem_error(hosts)  # the same on every rank, before NVSHMEM starts
        if error:
            raise RuntimeError(error)
        if not torch.cuda.is_available():
            raise RuntimeError("the nvshmem transport needs CUDA; on CPU use 'shm'")
        self.cfg = staging or StagingConfig.from_env()
        self.loopback = loopback
        self.stall_timeout_s = stall_timeout_s
        self._nv, self._Buffer, Device = _import_nvshmem()
        from . import kernels

        self._kernels = kernels
        self.group = group
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._heap_size = heap_bytes_available()
        self._heap_used = HEAP_RESERVE
        self._heap_peak = HEAP_RESERVE  # NVSHMEM keeps the heap it grew until finalize, whatever is freed
        self._bases: list[torch.Tensor] = []
        self._regions: dict[str, torch.Tensor] = {}  # name -> symmetric uint8 base tensor
        self._acc_ids: dict[str, int] = {}  # fp32 regions by the id a slot header names them with
        self._acc_table = torch.zeros(0, dtype=torch.int64, device=self.device)
        _acquire_runtime(self._nv, Device, group, self.rank, self.world_size, self.device.index)
        self._closed = False

        W, K = self.world_size, self.cfg.slots
        self._stage: torch.Tensor | None = None  # with the regions (_alloc_staging)
        self._outbox = self._bounce = None
        self._ctrl = self._malloc("the control words", 8 * control_words(W, self.cfg)).view(torch.int64)
        self._small_bounce = self._malloc("the control bounce buffer", 8 * NOTICE_WORDS)
        self._SIG, self._CREDIT = 0, W * K
        self._ARRIVE, self._EXPECT, self._COUNT_OUT = W * K + W, W * K + 2 * W, W * K + 3 * W
        self._ctrl_host = torch.zeros(self._ctrl.numel(), dtype=torch.int64, pin_memory=True)
        self._progress_stream = torch.cuda.Stream(self.device)
        self._aux_stream = torch.cuda.Stream(self.device)
        self._last_use: dict[str, torch.cuda.Event] = {}
        self._sent = [0] * W  # slots this rank put into each owner's inbox
        self._credit = [0] * W  # slots each owner reported folded (max seen)
        self._folded = [0] * W  # slots this rank folded from each sender
        self._publish_zeroed()
        self._alloc_failure_notices()
        self._accumulate_method = "staged"

    def accumulate_methods(self) -> tuple[str, ...]:
        return ("staged",)

    # -- symmetric memory -------------------------------------------------------------------------

    def _malloc(self, what: str, nbytes: int) -> torch.Tensor:
        """Collective; the same sizes on every rank, so every rank takes the same branch."""
        need = self._heap_used + aligned(nbytes)
        if need > self._heap_size:
            raise RuntimeError(heap_too_small_message(need, self._heap_size, what))
        try:
            base = self._nv.tensor((aligned(nbytes),), dtype=torch.uint8)
        except Exception as e:  # nvshmem4py raises NvshmemError (an Exception) when malloc fails
            raise RuntimeError(heap_too_small_message(need, self._heap_size, what) + f" [NVSHMEM: {e!r}]") from e
        self._heap_used = need
        self._heap_peak = max(self._heap_peak, need)
        self._bases.append(base)
        base.zero_()
        return base[:nbytes]

    def _free_symmetric(self, t: torch.Tensor) -> None:
        """Collective (nvshmem_free is): give back what `_malloc` returned as `t`."""
        index = next(i for i, base in enumerate(self._bases) if base.data_ptr() == t.data_ptr())
        base = self._bases.pop(index)
        self._heap_used -= base.numel()
        self._nv.free_tensor(base)

    def _alloc_staging(self) -> None:
        W, K, slot = self.world_size, self.cfg.slots, self.cfg.slot_bytes
        self._stage = self._malloc("the accumulate staging", staging_bytes(W, self.cfg))
        self._outbox = self._stage[W * K * slot : (W * K + 1) * slot]
        self._bounce = self._stage[(W * K + 1) * slot :]

    def _free_staging(self) -> None:
        self._progress_stream.synchronize()
        stage, self._stage, self._outbox, self._bounce = self._stage, None, None, None
        for what in ("outbox", "bounce"):
            self._last_use.pop(what, None)
        self._free_symmetric(stage)

    def _publish_zeroed(self) -> None:
        # nvshmem_malloc does not zero; a peer may put into this memory as soon as it returns from here,
        # so the zeros must be in place everywhere first.
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def _buf(self, t: torch.Tensor, byte_offset: int = 0, nbytes: int | None = None):
        """A cuda.core Buffer over part of a symmetric tensor (nvshmem4py only takes whole tensors)."""
        nbytes = t.numel() * t.element_size() - byte_offset if nbytes is None else nbytes
        return self._Buffer.from_handle(t.data_ptr() + byte_offset, nbytes)

    def _word(self, index: int):
        return self._buf(self._ctrl, 8 * index, 8)

    def _stream(self, s: torch.cuda.Stream):
        return self._nv.NvshmemStream(s)

    def _claim(self, what: str, stream: torch.cuda.Stream) -> None:
        """Order a use of a shared scratch buffer on `stream` after its last use on any stream."""
        ev = self._last_use.get(what)
        if ev is not None:
            stream.wait_event(ev)

    def _release(self, what: str, stream: torch.cuda.Stream) -> None:
        ev = torch.cuda.Event()
        ev.record(stream)
        self._last_use[what] = ev

    # -- regions ----------------------------------------------------------------------------------

    def alloc(self, name: str, numel: int, dtype: torch.dtype, timeout_s: float = SETUP_TIMEOUT_S) -> Region:
        self._check_alloc(name, numel, dtype, self._regions, timeout_s)
        # nvshmem_malloc is a collective NVSHMEM cannot interrupt: every rank is there before any enters it
        self._setup_meeting(name, timeout_s)
        first = self._stage is None and name not in self._control_names
        if first:
            self._alloc_staging()
        try:
            base = self._malloc(f"region '{name}'", numel * dtype.itemsize)
        except BaseException:
            if first:  # the heap check fails alike on every rank: the collective free matches
                self._free_staging()
            raise
        self._publish_zeroed()
        self._regions[name] = base
        if dtype == torch.float32:
            self._acc_ids[name] = len(self._acc_ids)
            self._refresh_acc_table()
        return Region(name, numel, dtype, base.view(dtype)[:numel])

    def _refresh_acc_table(self) -> None:
        self._progress_stream.synchronize()  # no fold may still read the table being replaced
        ptrs = [self._regions[n].data_ptr() for n in self._acc_ids]
        self._acc_table = torch.tensor(ptrs, dtype=torch.int64, device=self.device)

    def free(self, name: str) -> None:
        self._check_free(name, self._regions)
        torch.cuda.synchronize(self.device)
        base = self._regions.pop(name)
        if name in self._acc_ids:
            # ids name the fp32 regions in allocation order, alike on every rank (alloc and free are collective)
            del self._acc_ids[name]
            self._acc_ids = {n: i for i, n in enumerate(self._acc_ids)}
            self._refresh_acc_table()
        self._free_symmetric(base)
        if self._stage is not None and all(n in self._control_names for n in self._regions):
            self._free_staging()

    def region_bytes(self, region: Region) -> int:
        self._check_open()
        return aligned(region.numel * region.dtype.itemsize)

    def control_bytes(self) -> int:
        ctrl = aligned(self._ctrl.numel() * 8) + aligned(self._small_bounce.numel())
        return ctrl + super().control_bytes()

    def staging_bytes(self) -> int:
        self._check_open()
        return 0 if self._stage is None else aligned(self._stage.numel())

    def held_bytes(self, control: bool = False) -> int:
        """The symmetric heap as far as ODC ever grew it: nvshmem_free returns blocks to NVSHMEM's heap, which
        keeps its device memory until finalize (the process's end), so freed regions still count; less the
        control words without `control`."""
        self._check_open()
        control_held = 0 if control else self.control_bytes()
        return self._heap_peak - HEAP_RESERVE - control_held

    def mapped_bytes(self) -> int:
        self._check_open()
        # a peer reaches every symmetric allocation of this rank at the same offset of its heap
        return (self.world_size - 1) * (self._heap_used - HEAP_RESERVE)

    # -- get --------------------------------------------------------------------------------------

    def get(self, region: Region, peer: int, offset: int, out: torch.Tensor) -> None:
        n = self._check_transfer(region, peer, offset, out, "out")
        self._progress()
        if peer == self.rank and not self.loopback:
            out.view(-1).copy_(region.local[offset : offset + n])
            return
        stream = torch.cuda.current_stream(self.device)
        dst = out.view(-1).view(torch.uint8)
        base, start, total = self._regions[region.name], offset * region.dtype.itemsize, dst.numel()
        # the failure notices are read with no staging too (all regions released)
        bounce = self._bounce if self._bounce is not None else self._small_bounce
        step = bounce.numel()
        self._claim("bounce", stream)
        for pos in range(0, total, step):
            m = min(step, total - pos)
            # Blocking get on the stream: the bytes are in the bounce buffer when the stream moves on.
            self._nv.get(
                self._buf(bounce, 0, m),
                self._buf(base, start + pos, m),
                remote_pe=peer,
                stream=self._stream(stream),
            )
            dst[pos : pos + m].copy_(bounce[:m])
        self._release("bounce", stream)

    # -- accumulate -------------------------------------------------------------------------------

    def accumulate(self, region: Region, peer: int, offset: int, src: torch.Tensor) -> None:
        n = self._check_transfer(region, peer, offset, src, "src")
        if region.dtype != torch.float32:
            raise TypeError(f"accumulate needs a float32 region, '{region.name}' is {region.dtype}")
        self._progress()
        src = src.reshape(-1)
        if peer == self.rank and not self.loopback:
            self._kernels.accumulate(region.local[offset : offset + n], src, scope="gpu")
            return
        cap = self.cfg.payload_bytes // payload_dtype(src.dtype).itemsize
        stream = torch.cuda.current_stream(self.device)
        self._claim("outbox", stream)
        for pos in range(0, n, cap):
            m = min(cap, n - pos)
            q = self._sent[peer]
            self._wait_for_slot(peer, q)
            k = q % self.cfg.slots
            nbytes = pack_slot(self._outbox, offset + pos, src[pos : pos + m], self._acc_ids[region.name])
            slot_at = (self.rank * self.cfg.slots + k) * self.cfg.slot_bytes
            # One put carries header and payload; the signal (slot := q + 1) lands after both.
            self._nv.put_signal(
                self._buf(self._stage, slot_at, nbytes),
                self._buf(self._outbox, 0, nbytes),
                self._word(self._SIG + self.rank * self.cfg.slots + k),
                q + 1,
                self._nv.SignalOp.SIGNAL_SET,
                remote_pe=peer,
                stream=self._stream(stream),
            )
            self._sent[peer] = q + 1
        self._release("outbox", stream)

    def _wait_for_slot(self, owner: int, q: int) -> None:
        """Slot q % slots is free once the owner has folded message q - slots (credit >= q - slots + 1)."""
        if q - self._credit[owner] < self.cfg.slots:
            return

        def slot_free() -> bool:
            snap = self._progress()
            self._credit[owner] = max(self._credit[owner], snap[self._CREDIT + owner])
            return q - self._credit[owner] < self.cfg.slots

        poll(
            slot_free,
            self.stall_timeout_s,
            lambda: (
                f"rank {self.rank}: waited {self.stall_timeout_s:g}s for a free staging slot in rank {owner}; "
                f"rank {owner} is not folding its inbox (it is not calling the transport)"
            ),
        )

    def _snapshot(self) -> list[int]:
        # A plain read of words that peers update: it may be stale, never ahead. Anything acted upon is
        # then acquired through NVSHMEM (a stream wait on the signal) before its data is touched.
        with torch.cuda.stream(self._aux_stream):
            self._ctrl_host.copy_(self._ctrl, non_blocking=True)
        self._aux_stream.synchronize()
        return self._ctrl_host.tolist()

    def _progress(self) -> list[int]:
        """Fold every slot that arrived, in order per sender, and hand the slots back. Returns the snapshot."""
        snap = self._snapshot()
        if self._stage is None:
            return snap  # nothing can arrive: peers send only while the regions, and so the staging, exist
        K, ps = self.cfg.slots, self._progress_stream
        for s in range(self.world_size):
            q = start = self._folded[s]
            while snap[self._SIG + s * K + q % K] == q + 1:
                k = q % K
                with torch.cuda.stream(ps):
                    self._nv.signal_wait(
                        self._word(self._SIG + s * K + k),
                        q + 1,
                        self._nv.ComparisonType.CMP_GE,
                        stream=self._stream(ps),
                    )
                    slot_at = (s * K + k) * self.cfg.slot_bytes
                    self._kernels.fold_slot(
                        self._stage[slot_at : slot_at + self.cfg.slot_bytes],
                        self._acc_table,
                        self.cfg.payload_bytes // 2,
                        HEADER_BYTES,
                    )
                q += 1
            if q > start:
                self._folded[s] = q
                # Stream-ordered after the folds: the sender may overwrite the slots once it sees this.
                self._nv.signal_op(
                    self._word(self._CREDIT + self.rank),
                    q,
                    self._nv.SignalOp.SIGNAL_SET,
                    remote_pe=s,
                    stream=self._stream(ps),
                )
        return snap

    # -- waits ------------------------------------------------------------------------------------

    def barrier(self, timeout_s: float) -> None:
        self._check_wait(timeout_s)
        epoch = self._next_epoch()
        W, aux = self.world_size, self._aux_stream
        # Every put this rank enqueued has run (puts on the stream are locally complete) ...
        torch.cuda.synchronize(self.device)
        counts = torch.tensor(self._sent, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(aux):
            # ... and quiet makes them remotely complete: slots and signals are in the owners' memory.
            self._nv.quiet(stream=self._stream(aux))
            self._ctrl[self._COUNT_OUT : self._COUNT_OUT + W].copy_(counts, non_blocking=True)
            for owner in range(W):
                # expect[me] := slots sent to `owner`, then arrive[me] := epoch, in that order.
                self._nv.put_signal(
                    self._word(self._EXPECT + self.rank),
                    self._word(self._COUNT_OUT + owner),
                    self._word(self._ARRIVE + self.rank),
                    epoch,
                    self._nv.SignalOp.SIGNAL_SET,
                    remote_pe=owner,
                    stream=self._stream(aux),
                )
        deadline = time.monotonic() + timeout_s

        def missing() -> list[int]:
            snap = self._progress()
            return [r for r in range(W) if not self.peer_arrived(r, snap[self._ARRIVE + r], epoch)]

        self.wait_for_arrivals(missing, epoch, timeout_s)
        with torch.cuda.stream(aux):
            for r in range(W):  # acquire each arrival before reading the count that came with it
                self._nv.signal_wait(
                    self._word(self._ARRIVE + r), epoch, self._nv.ComparisonType.CMP_GE, stream=self._stream(aux)
                )
        expect = self._snapshot()[self._EXPECT : self._EXPECT + W]  # runs on `aux`, after the waits
        behind: list[int] = []

        def folded_all() -> bool:
            self._progress()
            behind[:] = [r for r in range(W) if self._folded[r] < expect[r]]
            return not behind

        poll(
            folded_all,
            max(deadline - time.monotonic(), 0.0),
            lambda: (
                f"rank {self.rank}: {self._meeting_name(epoch)} timed out after {timeout_s:g}s; accumulates "
                f"from rank(s) {behind} were announced but never arrived"
            ),
        )
        # The folds are complete before the caller reads its accumulator.
        self._progress_stream.synchronize()

    def synchronize(self) -> None:
        self._check_open()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        # nvshmem_free is collective: every rank closes its transport (the FSDP layer does, on every rank).
        for base in reversed(self._bases):
            self._nv.free_tensor(base)
        self._bases.clear()
        self._regions.clear()
        _release_runtime(self._nv)
