"""The one-sided operations ODC needs, independent of FSDP.

A transport connects the ranks of one process group. Each rank owns one slice of every *symmetric
region* (the same size on every rank); any rank may read a peer's slice (`get`) or add into it
(`accumulate`) without the peer taking part. The only meeting point is `barrier`, once per mini-batch.

Set-up (`alloc`) and release (`free`) are collective and run outside mini-batches; `get`, `accumulate`
and `barrier` never call a collective on the process group, which is what lets ranks drift apart between
barriers. Once the control words exist, `alloc` meets its peers at the transport's own barrier before any
step a peer could be missing from, so a rank whose set-up failed, once it announced it, ends its peers'
wait at once instead of leaving them in a collective it never joins. A transport holds, from start to
`close`, only its *control words* (arrival flags, doorbells, failure notices: `control_bytes`, a few KiB);
everything else it holds belongs to regions, freed with them.

Accumulate methods (`ACCUMULATE_METHODS`): "direct" adds straight into the owner's accumulator, safe
against concurrent writers (GPU peer atomics, record locks on CPU); "slots" gives every sender a slot of
its own, the accumulator's size, in the owner's memory, which the sender adds into alone (no atomics, no
locks) and the owner folds into its accumulator at the barrier (slots.py). A transport offers what its
peers' memory allows (`accumulate_methods`), and the method is fixed while any accumulator exists;
nvshmem has one of its own ("staged": slots fed by messages, folded whenever the owner calls the transport).

Every wait also reads the peers' failure notices (failure.py), so that a failed peer ends it at once.
"""

from __future__ import annotations

import abc
import math
import numbers
import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from .failure import ROUND_SHIFT, FailureNotice, FailureNotices, ODCTimeoutError
from .slots import Slots

# How long `alloc` waits for its peers unless told otherwise: ODCConfig's barrier timeout by default.
SETUP_TIMEOUT_S = 600.0


def poll(ready: Callable[[], bool], timeout_s: float, error: Callable[[], str]) -> None:
    """Call `ready` with growing pauses (10 us to 1 ms) until it returns True; after `timeout_s` raise
    ODCTimeoutError with the message `error()` builds then (it may name what is still missing)."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not ready():
        if time.monotonic() > deadline:
            raise ODCTimeoutError(error())
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def is_positive_finite(value) -> bool:
    """Whether `value` is a real number (not a bool), finite and > 0: a timeout, a divide factor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_timeout(timeout_s: float) -> None:
    """Refuse a wait's `timeout_s` unless it is a finite number of seconds > 0 (a bool is not one)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not is_positive_finite(timeout_s):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")


AccumulateMethod = Literal["direct", "slots"]
ACCUMULATE_METHODS: tuple[str, ...] = get_args(AccumulateMethod)

# (src dtype, region dtype) pairs `accumulate` takes besides equal ones: bf16 gradients added into an fp32
# accumulator widen exactly (the GPU kernels read bf16 directly; nvshmem ships it as bf16).
_WIDENING_ADDS = frozenset({(torch.bfloat16, torch.float32)})


@dataclass(frozen=True)
class Region:
    """A symmetric region: `numel` elements of `dtype` on every rank, `local` is this rank's slice."""

    name: str
    numel: int
    dtype: torch.dtype
    local: torch.Tensor


class Transport(FailureNotices, abc.ABC):
    """One-sided get / accumulate over symmetric regions, a timed barrier, and failure notices."""

    name: str = "transport"
    """Its name in make_transport (TRANSPORTS)."""

    group: dist.ProcessGroup | None = None
    """The process group it spans (None: the default group)."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        FailureNotices.__init__(self)
        self._setting_up: str | None = None  # the region whose set-up meeting runs
        self._setup_meetings = 0  # set-up meetings in this round, which errors do not number as barriers
        self._control: list[Region] = []  # the regions the transport itself holds until close
        self._control_names: set[str] = set()  # theirs, known to `alloc` while it allocates one
        self._allocating_control = False  # only `_alloc_control` may allocate a name in _control_names
        self._closed = False
        self._accumulate_method = "direct"
        # the accumulate targets (float32 regions other than the control words), with their slots under "slots"
        self._accumulators: dict[str, Slots | None] = {}

    @property
    def accumulate_method(self) -> str:
        """How `accumulate` adds into the accumulators allocated from now on (ACCUMULATE_METHODS)."""
        return self._accumulate_method

    def accumulate_methods(self) -> tuple[str, ...]:
        """The accumulate methods this transport offers: "direct" alone by default (nvshmem: "staged", its own)."""
        return ("direct",)

    def set_accumulate_method(self, method: str) -> None:
        """Use `method` for the accumulators allocated from now on; refused while any exists (each keeps the
        layout it was allocated with)."""
        self._check_open()
        if method not in self.accumulate_methods():
            offered = ", ".join(self.accumulate_methods())
            raise ValueError(f"{type(self).__name__} offers the accumulate method(s) {offered}, not {method!r}")
        if method != self.accumulate_method and self._accumulators:
            raise RuntimeError(
                f"the accumulate method changes only while no accumulator exists; free {sorted(self._accumulators)}"
            )
        self._accumulate_method = method

    def _gets_slots(self, name: str, dtype: torch.dtype) -> bool:
        return (
            self.accumulate_method == "slots"
            and self.world_size > 1
            and dtype == torch.float32
            and name not in self._control_names
        )

    def _allocated_numel(self, name: str, numel: int, dtype: torch.dtype) -> int:
        """Elements to allocate on every rank for region `name`: its own, and its slots under "slots"."""
        return Slots.allocated_numel(numel, self.world_size) if self._gets_slots(name, dtype) else numel

    def _allocated(self, name: str, numel: int, dtype: torch.dtype, local: torch.Tensor) -> None:
        """Region `name` was allocated, `local` being all of this rank's `_allocated_numel` elements."""
        if dtype == torch.float32 and name not in self._control_names:
            self._accumulators[name] = Slots(numel, self.world_size, local) if self._gets_slots(name, dtype) else None

    def _slot(self, region: Region, peer_full: torch.Tensor, peer: int) -> torch.Tensor | None:
        """This rank's slot in `peer`'s allocation of `region` (`peer_full`, mapped here), or None where the
        add goes straight into the accumulator (the direct method, or this rank's own)."""
        slots = self._accumulators.get(region.name)
        return None if slots is None or peer == self.rank else slots.slot_in(peer_full, self.rank, peer)

    def _fold_slots(self, meet: Callable[[float], None], timeout_s: float) -> None:
        """Once every rank has met at a barrier (every add has landed): fold this rank's slots into its
        accumulators and meet again, so that no sender adds into a slot before it is zeroed. In a recovery
        the adds of the failed round are dropped instead."""
        slotted = [s for s in self._accumulators.values() if s is not None]
        if not slotted:
            return
        for slots in slotted:
            slots.fold(keep=not self._recovering)
        meet(timeout_s)

    def _alloc_control(self, name: str, numel: int, dtype: torch.dtype) -> Region:
        """Collective, during set-up: a region of the transport's own control words, held until `close`."""
        self._control_names.add(name)
        self._allocating_control = True
        try:
            region = self.alloc(name, numel, dtype)
        finally:
            self._allocating_control = False
        self._control.append(region)
        return region

    # Every public call checks its arguments first, with these, so that a call refused for misuse changes
    # nothing: no region half registered, no barrier arrival written that its peers would count.

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: the ODC transport is closed; make a new one to use it again")

    def _check_alloc(
        self, name: str, numel: int, dtype: torch.dtype, allocated: Container[str], timeout_s: float
    ) -> None:
        """`alloc`'s arguments; `allocated`: the names of the transport's regions."""
        self._check_open()
        check_timeout(timeout_s)
        if not isinstance(name, str) or not name or "/" in name or "\0" in name:
            raise ValueError(f"region name must be a non-empty str without '/' or NUL, got {name!r}")
        if name in self._control_names and not self._allocating_control:
            raise ValueError(f"region name '{name}' is the transport's own control words; choose another name")
        if name in allocated:
            raise ValueError(f"region '{name}' is already allocated; free('{name}') it first or choose another name")
        if isinstance(numel, bool) or not isinstance(numel, numbers.Integral):
            raise TypeError(f"numel of region '{name}' must be an int, got {numel!r}")
        if numel < 1:
            raise ValueError(f"numel of region '{name}' must be >= 1, got {numel}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype of region '{name}' must be a torch.dtype, got {dtype!r}")

    def _check_free(self, name: str, allocated: Container[str]) -> None:
        """`free`'s argument; `allocated`: the names of the transport's regions."""
        self._check_open()
        if name in self._control_names:
            raise ValueError(f"region '{name}' is the transport's own control words; close() releases them")
        if not isinstance(name, str) or name not in allocated:
            raise ValueError(f"no region {name!r} to free: it was never allocated or is already freed")

    def _check_wait(self, timeout_s: float) -> None:
        """A wait's `timeout_s`, before the wait writes anything its peers read."""
        self._check_open()
        check_timeout(timeout_s)

    def _check_transfer(self, region: Region, peer: int, offset: int, tensor: torch.Tensor, arg: str) -> int:
        """`get`'s `out` (arg "out") or `accumulate`'s `src` (arg "src") and the range they span; returns
        its numel. Per layer, so a few attribute reads: no copy, no device sync."""
        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != region.dtype and not (arg == "src" and (tensor.dtype, region.dtype) in _WIDENING_ADDS):
            raise TypeError(
                f"{arg} is {tensor.dtype} but region '{region.name}' is {region.dtype}; "
                f"convert it to {region.dtype} (no transport casts silently)"
            )
        if tensor.device != region.local.device:
            raise ValueError(f"{arg} is on {tensor.device} but region '{region.name}' is on {region.local.device}")
        n = tensor.numel()
        self._check_range(region, peer, offset, n)
        return n

    @abc.abstractmethod
    def alloc(self, name: str, numel: int, dtype: torch.dtype, timeout_s: float = SETUP_TIMEOUT_S) -> Region:
        """Collective: every rank allocates `numel` (>= 1) zeroed elements that all peers can reach. `name`:
        a non-empty str without '/' or NUL, not a region already allocated nor one of the transport's own.
        A rank waits for its peers at `_setup_meeting`: a peer's announced failure raises ODCPeerFailedError
        there, a peer that does not come within `timeout_s` ODCTimeoutError. A rank whose own step fails
        raises having kept nothing of the region."""

    def _setup_meeting(self, name: str, timeout_s: float) -> None:
        """Where `alloc(name)` waits for every peer. The control words are set up before any failure notice
        exists, so they meet in the process group; every other region at the transport's own barrier, whose
        waits read the notices."""
        if name in self._control_names:
            dist.barrier(group=self.group)
            return
        self._setting_up = name
        try:
            self._meet(timeout_s)
        finally:
            self._setting_up = None
        self._setup_meetings += 1

    def _meet(self, timeout_s: float) -> None:
        """Every rank arrives, as at `barrier`; a transport whose barrier does more (folding slots) meets
        with less here."""
        self.barrier(timeout_s)

    @abc.abstractmethod
    def free(self, name: str) -> None:
        """Collective: every rank releases its slice of region `name` and its mappings of the peers' slices,
        so that the memory returns to the system once every rank has freed it. Every rank frees the same
        regions in the same order, with no get or accumulate of them in flight (after a barrier). The region
        is gone from the transport at once (its name may be allocated again, `mapped_bytes` no longer counts
        it); a tensor still viewing it, its Region's `local` say, keeps only that memory alive until the
        tensor itself goes. Raises ValueError for a name that is not a region, or is the transport's own."""

    @abc.abstractmethod
    def region_bytes(self, region: Region) -> int:
        """Bytes this rank's slice of `region` takes, as the transport allocated it."""

    def control_bytes(self) -> int:
        """Bytes of this rank's control words: what the transport holds from start to `close`, whatever
        regions exist."""
        self._check_open()
        return sum(self.region_bytes(r) for r in self._control)

    def held_bytes(self, control: bool = False) -> int:
        """Bytes of this rank's own memory the transport's regions hold now, measured where the system keeps
        them (not counted from `region_bytes`): a region freed while a tensor still views it counts until the
        tensor goes. The control words only with `control`. This base measures nothing: its bookkeeping."""
        self._check_open()
        return sum(self.region_bytes(r) for r in self._control) if control else 0

    def staging_bytes(self) -> int:
        """Bytes of this rank's staging buffers (none here), held while any region other than the control
        words exists."""
        self._check_open()
        return 0

    @abc.abstractmethod
    def mapped_bytes(self) -> int:
        """Bytes of the peers' slices, every region's, that this rank maps."""

    @abc.abstractmethod
    def get(self, region: Region, peer: int, offset: int, out: torch.Tensor) -> None:
        """Copy `out.numel()` elements of `peer`'s slice, starting at `offset`, into `out` (a tensor of the
        region's dtype, on its device)."""

    @abc.abstractmethod
    def accumulate(self, region: Region, peer: int, offset: int, src: torch.Tensor) -> None:
        """Add `src` into `peer`'s slice at `offset`; concurrent writers from many ranks lose nothing. `src`
        is of the region's dtype (or bf16 into an fp32 region), on its device.

        The owner's own writes to its slice (zeroing it after a barrier) must be finished before peers
        accumulate again; the FSDP layer orders this with its "published" flag.
        """

    @abc.abstractmethod
    def barrier(self, timeout_s: float) -> None:
        """Wait until every rank arrives, with every earlier accumulate visible to its owner.

        Raises ODCTimeoutError naming the missing ranks after `timeout_s` seconds, and ODCPeerFailedError
        as soon as a peer announces a failure. Implementations meet at epoch `self._next_epoch()`, count a
        peer as there when `peer_arrived(peer, its word, epoch)`, and call `_passed` once they pass.
        """

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def _passed(self, epoch: int) -> None:
        """This rank passed barrier `epoch`: a failure it announces later in the round says so."""
        self._passed_epoch = epoch

    def _meeting_name(self, epoch: int) -> str:
        """How errors name this transport's meeting `epoch`: a region's set-up by the region, a barrier by its
        number among the round's barriers (a job's first mini-batch ends at "ODC barrier #1", whatever was set
        up before it)."""
        if self._setting_up is not None:
            return f"the set-up of ODC region '{self._setting_up}'"
        return self.barrier_name(epoch - self._setup_meetings if epoch % (1 << ROUND_SHIFT) else epoch)

    def wait_at_least(self, region: Region, peer: int, offset: int, value: int, timeout_s: float, what: str) -> None:
        """Wait until an int64 flag in `peer`'s slice reaches `value`; `what` names the wait in the error.

        Point-to-point: only `peer` has to have got there, nobody else.
        """
        self._check_wait(timeout_s)
        flag = torch.empty(1, dtype=region.dtype, device=region.local.device)

        def waiting_on() -> int | None:
            self.get(region, peer, offset, flag)
            return None if int(flag.item()) >= value else peer

        self.wait_until(
            waiting_on,
            timeout_s,
            lambda: f"rank {self.rank}: waited {timeout_s:g}s for {what}; rank {peer} did not get there",
        )

    def wait_for_arrivals(self, missing: Callable[[], list[int]], epoch: int, timeout_s: float) -> None:
        """Wait until `missing()` (the ranks not yet at barrier `epoch`) is empty; name them on timeout."""
        self._check_wait(timeout_s)
        last: list[int] = []

        def waiting_on() -> int | None:
            last[:] = missing()
            return last[0] if last else None

        self.wait_until(
            waiting_on,
            timeout_s,
            lambda: (
                f"rank {self.rank}: {self._meeting_name(epoch)} timed out after {timeout_s:g}s; "
                f"rank(s) {last} did not arrive"
            ),
        )
        self._passed(epoch)

    def wait_until(self, waiting_on: Callable[[], int | None], timeout_s: float, error: Callable[[], str]) -> None:
        """Return once `waiting_on()` is None; until then it names a peer whose flag this rank still waits
        for. Raises ODCTimeoutError(error()) after `timeout_s`, and ODCPeerFailedError as soon as a peer
        announces a failure (outside a recovery, whose very point is that they did). Between checks the rank
        sleeps (here with growing pauses; a transport that can be woken sleeps until that peer changes a flag)."""
        self._check_wait(timeout_s)

        def ready() -> bool:
            failed = self._peer_failure()
            # A peer may pass this wait and fail its next step before this rank sees the wait end: a failure
            # read before the wait was found over, with the wait still on, is one of this step.
            if waiting_on() is None:
                return True
            if failed is not None:
                raise failed
            return False

        poll(ready, timeout_s, error)

    def signal(self, region: Region, offset: int, value: int) -> None:
        """Set an int64 flag in this rank's own slice, after every transfer this rank issued before it;
        peers waiting for it in wait_at_least see it."""
        self._check_open()
        self.synchronize()
        region.local[offset] = value

    def synchronize(self) -> None:
        """Wait for this rank's outstanding asynchronous transfers (no-op for synchronous transports)."""
        self._check_open()

    def close(self) -> None:
        """Release the regions; safe to call twice. Collective for some transports (nvshmem): every
        rank calls it, in the same order. Every other call raises RuntimeError afterwards."""

    def _check_range(self, region: Region, peer: int, offset: int, n: int) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer {peer} out of range for world size {self.world_size}")
        if offset < 0 or offset + n > region.numel:
            raise ValueError(
                f"range [{offset}, {offset + n}) outside region '{region.name}' of {region.numel} elements"
            )


class DelegatingTransport(Transport):
    """A transport that hands every call to `inner`, whose regions, waits, failure notices and round state
    are the ones in use; a subclass overrides only the calls it times or watches (odc-demo's timeline,
    tests that delay a stream)."""

    def __init__(self, inner: Transport):
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner
        self.name = inner.name

    def alloc(self, name: str, numel: int, dtype: torch.dtype, timeout_s: float = SETUP_TIMEOUT_S) -> Region:
        return self.inner.alloc(name, numel, dtype, timeout_s)

    def free(self, name: str) -> None:
        self.inner.free(name)

    def region_bytes(self, region: Region) -> int:
        return self.inner.region_bytes(region)

    def control_bytes(self) -> int:
        return self.inner.control_bytes()

    def staging_bytes(self) -> int:
        return self.inner.staging_bytes()

    def mapped_bytes(self) -> int:
        return self.inner.mapped_bytes()

    def held_bytes(self, control: bool = False) -> int:
        return self.inner.held_bytes(control)

    @property
    def accumulate_method(self) -> str:
        return self.inner.accumulate_method

    def accumulate_methods(self) -> tuple[str, ...]:
        return self.inner.accumulate_methods()

    def set_accumulate_method(self, method: str) -> None:
        self.inner.set_accumulate_method(method)

    def get(self, region: Region, peer: int, offset: int, out: torch.Tensor) -> None:
        self.inner.get(region, peer, offset, out)

    def accumulate(self, region: Region, peer: int, offset: int, src: torch.Tensor) -> None:
        self.inner.accumulate(region, peer, offset, src)

    def barrier(self, timeout_s: float) -> None:
        self.inner.barrier(timeout_s)

    def wait_at_least(self, region: Region, peer: int, offset: int, value: int, timeout_s: float, what: str) -> None:
        self.inner.wait_at_least(region, peer, offset, value, timeout_s, what)

    def signal(self, region: Region, offset: int, value: int) -> None:
        self.inner.signal(region, offset, value)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def announce_failure(self, message: str) -> None:
        self.inner.announce_failure(message)

    def failures(self) -> list[FailureNotice]:
        return self.inner.failures()

    def raise_if_a_peer_failed(self) -> None:
        self.inner.raise_if_a_peer_failed()

    def recover(self, timeout_s: float) -> list[FailureNotice]:
        return self.inner.recover(timeout_s)

    def close(self) -> None:
        self.inner.close()
