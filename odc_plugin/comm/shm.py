"""Shared-memory transport: ranks on one machine, CPU tensors.

Every region is one file per rank in /dev/shm, mapped by all ranks of the group. A `get` is a plain copy
out of the peer's mapping. An `accumulate` ("direct") takes a POSIX record lock on exactly the bytes it
adds into, so writers to disjoint ranges run in parallel and writers to the same range serialize; the
kernel drops the lock if its holder dies, so a killed rank cannot wedge the others. Under "slots"
(slots.py) it adds into its own slot of the owner's file with no lock.

A waiting rank sleeps in the kernel and takes no core: every rank owns a doorbell word that it bumps
(and wakes its sleepers on) whenever it raises one of its flags, and a rank waiting for a peer's flag
sleeps on that peer's doorbell (futex.py).

Files. A region's files exist only while it is set up: every rank unlinks them once all have mapped them.
A rank killed in between (waiting in `alloc` for a slow peer) runs no clean-up, so every file's name
carries the pid of the rank that created it, `odc-<token>-<region>-r<rank>-p<pid>`: a launcher that
killed ranks removes theirs (`remove_files_of`), and every new transport removes those of dead creators
older than an hour (a job killed under torchrun). A file whose creator's pid was reused by a live process
stays.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from . import futex
from .base import ACCUMULATE_METHODS, SETUP_TIMEOUT_S, Region, Transport
from .failure import ODCPeerFailedError, ODCTimeoutError

_SHM_DIR = "/dev/shm"
# A region file's name; `creator` is the pid of the process that created it.
_FILE = re.compile(r"odc-[0-9a-f]{12}-.+-r\d+-p(?P<creator>\d+)")
# A sleeper re-checks its condition at least this often, whatever it was woken by: a wake-up missed in
# a race (a flag raised between its check and its sleep) costs at most this long.
_RECHECK_S = 0.05


class _Mapping:
    """One rank's file of a region, mapped into this process."""

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, nbytes)
        self.nbytes = nbytes
        self.mm = mmap.mmap(self.fd, nbytes)

    def tensor(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        # Through a memoryview: frombuffer releases its own export of the buffer at once, so over the mmap
        # itself `mm.close()` would unmap memory that tensors still view. The memoryview's export lives as
        # long as any tensor sharing this storage, and keeps `close()` from unmapping it.
        return torch.frombuffer(memoryview(self.mm), dtype=dtype, count=numel)

    def close(self) -> None:
        """Unmap and close the file, which is gone with its last mapping. A tensor made by frombuffer, or a
        view of one, that still points into the mapping keeps it (its memoryview holds the mmap): Python
        unmaps it when the last such tensor is freed."""
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def remove_files_of(pids: Iterable[int]) -> int:
    """Unlink the /dev/shm files of ODC's shared-memory regions that processes `pids` created and left
    behind (a launcher calls this once it has killed them; the files of live processes must stay, their
    peers may still be opening them). Returns how many it removed."""
    pids = {int(p) for p in pids}
    return _remove_files(lambda creator: creator in pids)


def _remove_files(left_behind: Callable[[int], bool], older_than_s: float = 0.0) -> int:
    removed, cutoff = 0, time.time() - older_than_s
    for entry in os.scandir(_SHM_DIR):
        match = _FILE.fullmatch(entry.name)
        if match and left_behind(int(match["creator"])) and _modified_before(entry, cutoff):
            # gone: a peer removed it at the same time; refused: another user's (/dev/shm is sticky)
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(entry.path)
                removed += 1
    return removed


# A file a dead creator left is removed by a new transport only once it is this old: a live job in another
# pid namespace that shares /dev/shm (where its creators' pids look dead) holds its files only while a
# region is set up, well under an hour.
_STALE_S = 3600.0


def _modified_before(entry: os.DirEntry, cutoff: float) -> bool:
    try:
        return entry.stat().st_mtime <= cutoff
    except FileNotFoundError:
        return False


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie, not yet reaped by its launcher, included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        # Files a killed job left (see the module); before any rank of this one creates its own.
        _remove_files(_dead, older_than_s=_STALE_S)
        # Rank 0's token names this transport's files; every rank's pid, the files it creates.
        ids: list = [None] * self.world_size
        dist.all_gather_object(ids, (uuid.uuid4().hex[:12], os.getpid()), group=group)
        self._pids = [pid for _, pid in ids]
        # Where this transport's files live in /dev/shm, and only while a region is being set up.
        self.path_prefix = os.path.join(_SHM_DIR, f"odc-{ids[0][0]}")
        # A peer that dies announces nothing: a wait for one whose process this rank sees ends once it is
        # gone, not at the timeout (one that exits during a region's set-up, say, which a collective noticed).
        self._watched = {r: pid for r, pid in enumerate(self._pids) if r != self.rank and not _gone(pid)}
        self._mappings: dict[str, list[_Mapping]] = {}
        self._peer_tensors: dict[str, list[torch.Tensor]] = {}
        # Record locks belong to the process, not the thread: threads of one rank exclude each other here.
        self._thread_lock = threading.Lock()
        self._doorbells = self._alloc_control("odc.doorbell", 1, torch.int32)
        self._arrivals = self._alloc_control("odc.barrier", 1, torch.int64)
        self._alloc_failure_notices()

    def accumulate_methods(self) -> tuple[str, ...]:
        return ACCUMULATE_METHODS

    def alloc(self, name: str, numel: int, dtype: torch.dtype, timeout_s: float = SETUP_TIMEOUT_S) -> Region:
        self._check_alloc(name, numel, dtype, self._mappings, timeout_s)
        total = self._allocated_numel(name, numel, dtype)
        nbytes = total * dtype.itemsize
        paths = [f"{self.path_prefix}-{name}-r{r}-p{pid}" for r, pid in enumerate(self._pids)]
        mappings: list[_Mapping] = []
        try:
            mappings.append(_Mapping(paths[self.rank], nbytes, create=True))
            self._setup_meeting(name, timeout_s)
            mappings = [
                mappings[0] if r == self.rank else _Mapping(paths[r], nbytes, create=False)
                for r in range(self.world_size)
            ]
            self._setup_meeting(name, timeout_s)
        except Exception as e:
            for m in mappings:
                m.close()
            if isinstance(e, ODCPeerFailedError):  # its notice says which rank failed, and how
                raise
            raise RuntimeError(
                f"rank {self.rank}: setting up shared-memory region '{name}' "
                f"({self.path_prefix}-{name}-r*) failed (did a peer die?): {e}"
            ) from e
        finally:
            # Once every rank holds every mapping the names are no longer needed, and unlinking now means
            # a crash leaves nothing behind in /dev/shm. Every rank unlinks every name, so that a peer
            # dying before it unlinked its own file, or before its peers mapped it, leaves none either.
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._mappings[name] = mappings
        self._peer_tensors[name] = [m.tensor(dtype, total) for m in mappings]
        self._allocated(name, numel, dtype, self._peer_tensors[name][self.rank])
        return Region(name, numel, dtype, self._peer_tensors[name][self.rank][:numel])

    def free(self, name: str) -> None:
        # Local: a peer still mapping its own copy of this rank's file keeps only its own mapping alive, and
        # every file was unlinked at set-up, so nothing is left to meet about.
        self._check_free(name, self._mappings)
        del self._peer_tensors[name]
        self._accumulators.pop(name, None)
        for m in self._mappings.pop(name):
            m.close()

    def region_bytes(self, region: Region) -> int:
        self._check_open()
        return self._mappings[region.name][self.rank].nbytes

    def held_bytes(self, control: bool = False) -> int:
        """This rank's own region files mapped in this process, read from /proc/self/maps (pages, as mapped)."""
        self._check_open()
        own = re.compile(
            re.escape(self.path_prefix) + rf"-(?P<region>.+)-r{self.rank}-p{self._pids[self.rank]}( \(deleted\))?"
        )
        total = 0
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                match = len(fields) == 6 and own.fullmatch(fields[5].strip())
                if match and (control or match["region"] not in self._control_names):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    total += end - start
        return total

    def mapped_bytes(self) -> int:
        self._check_open()
        return sum(m.nbytes for maps in self._mappings.values() for r, m in enumerate(maps) if r != self.rank)

    def get(self, region: Region, peer: int, offset: int, out: torch.Tensor) -> None:
        n = self._check_transfer(region, peer, offset, out, "out")
        out.view(-1).copy_(self._peer_tensors[region.name][peer][offset : offset + n])

    def accumulate(self, region: Region, peer: int, offset: int, src: torch.Tensor) -> None:
        n = self._check_transfer(region, peer, offset, src, "src")
        full = self._peer_tensors[region.name][peer]
        slot = self._slot(region, full, peer)
        if slot is not None:
            slot[offset : offset + n].add_(src.reshape(-1))  # no other writer
            return
        itemsize = region.dtype.itemsize
        with self._locked(self._mappings[region.name][peer].fd, offset * itemsize, n * itemsize):
            full[offset : offset + n].add_(src.reshape(-1))

    @contextlib.contextmanager
    def _locked(self, fd: int, start: int, nbytes: int):
        with self._thread_lock:
            fcntl.lockf(fd, fcntl.LOCK_EX, nbytes, start, os.SEEK_SET)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, nbytes, start, os.SEEK_SET)

    def signal(self, region: Region, offset: int, value: int) -> None:
        super().signal(region, offset, value)
        self._ring()

    def _ring(self) -> None:
        """Wake the ranks sleeping on this rank's doorbell: one of its flags changed. Only this rank
        writes its doorbell, so the increment needs no lock."""
        bell = self._doorbells.local
        bell += 1
        futex.wake(bell.data_ptr())

    def wait_until(self, waiting_on: Callable[[], int | None], timeout_s: float, error: Callable[[], str]) -> None:
        self._check_wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        bells = self._peer_tensors["odc.doorbell"]
        while True:
            failed = self._peer_failure()  # read before the wait is checked, as in Transport.wait_until
            if (peer := waiting_on()) is None:
                return
            if failed is not None:
                raise failed
            # Read the doorbell before checking again: a flag raised after that check also rings after
            # the read, so the sleep below returns at once instead of missing it.
            rung = int(bells[peer][0])
            if waiting_on() != peer:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise ODCTimeoutError(error())
            if peer in self._watched and _gone(self._watched[peer]):
                raise ODCTimeoutError(f"rank {peer}'s process (pid {self._watched[peer]}) has exited")
            futex.wait(bells[peer].data_ptr(), rung, min(left, _RECHECK_S))

    def barrier(self, timeout_s: float) -> None:
        self._meet(timeout_s)
        self._fold_slots(self._meet, timeout_s)

    def _meet(self, timeout_s: float) -> None:
        # Each rank writes its arrival (the epoch) into its own word and waits for everyone else's. A rank
        # that times out writes -epoch instead: it gave up, and a rank arriving after that must fail here
        # rather than pass a barrier its peers have left. Arriving and the final decision (pass, give up
        # or fail) happen under one lock, so a late arrival is either seen by the rank that would give up,
        # or sees that it gave up. Accumulates finished before the arrival, which is written under the
        # lock: taking it is a system call, so the adds are in memory before any peer can see the epoch.
        self._check_wait(timeout_s)
        epoch, words = self._next_epoch(), [t[0] for t in self._peer_tensors["odc.barrier"]]
        decision_lock = (self._mappings["odc.barrier"][0].fd, 0, 8)
        with self._locked(*decision_lock):
            self._arrivals.local[0] = epoch
        self._ring()

        def missing() -> list[int]:
            return [r for r, word in enumerate(words) if int(word) >= 0 and not self.peer_arrived(r, int(word), epoch)]

        ended = f"timed out after {timeout_s:g}s"
        try:
            self.wait_until(lambda: next(iter(missing()), None), timeout_s, lambda: "")
        except ODCTimeoutError as e:
            ended = f"failed ({e})" if str(e) else ended  # a peer's process exited, or the time is up
        with self._locked(*decision_lock):
            late = missing()
            gave_up = [r for r, word in enumerate(words) if int(word) < 0]
            if late:
                self._arrivals.local[0] = -epoch
        if late:
            self._ring()
            raise ODCTimeoutError(
                f"rank {self.rank}: {self._meeting_name(epoch)} {ended}; rank(s) {late} did not arrive"
            )
        if gave_up:
            raise ODCTimeoutError(
                f"rank {self.rank}: {self._meeting_name(epoch)} failed: rank(s) {gave_up} timed out "
                f"waiting at it and gave up before every rank arrived"
            )
        self._passed(epoch)

    def close(self) -> None:
        self._closed = True
        self._peer_tensors.clear()
        for mappings in self._mappings.values():
            for m in mappings:
                m.close()
        self._mappings.clear()
