"""Shared-memory transport: ranks on one machine, CPU tensors.

Every region is one file per rank in /dev/shm, mapped by all ranks of the group. A `get` is a plain copy
out of the peer's mapping. An `accumulate` takes a POSIX record lock on exactly the bytes it adds into,
so writers to disjoint ranges run in parallel and writers to the same range serialize; the kernel drops
the lock if its holder dies, so a killed rank cannot wedge the others.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import uuid

import torch
import torch.distributed as dist

from .base import Region, Transport

_SHM_DIR = "/dev/shm"


class _Mapping:
    """One rank's file of a region, mapped into this process."""

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, nbytes)
        self.mm = mmap.mmap(self.fd, nbytes)

    def tensor(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=dtype, count=numel)

    def close(self) -> None:
        # Tensors made by frombuffer may still point into the mapping; leave it to the GC then.
        try:
            self.mm.close()
        except BufferError:
            pass
        os.close(self.fd)


class ShmTransport(Transport):
    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        self._prefix = os.path.join(_SHM_DIR, f"odc-{token[0]}")
        self._mappings: dict[str, list[_Mapping]] = {}
        self._peer_tensors: dict[str, list[torch.Tensor]] = {}
        # Record locks belong to the process, not the thread: threads of one rank exclude each other here.
        self._thread_lock = threading.Lock()
        self._arrivals = self.alloc("odc.barrier", 1, torch.int64)
        self._epoch = 0

    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> Region:
        if name in self._mappings:
            raise ValueError(f"region '{name}' is already allocated")
        nbytes = max(numel * dtype.itemsize, 1)
        path = f"{self._prefix}-{name}-r{{}}"
        own = _Mapping(path.format(self.rank), nbytes, create=True)
        dist.barrier(group=self.group)
        mappings = [own if r == self.rank else _Mapping(path.format(r), nbytes, create=False) for r in range(self.world_size)]
        # Once every rank holds every mapping, the names are no longer needed: unlinking now means a crash
        # leaves nothing behind in /dev/shm.
        dist.barrier(group=self.group)
        os.unlink(path.format(self.rank))
        self._mappings[name] = mappings
        self._peer_tensors[name] = [m.tensor(dtype, numel) for m in mappings]
        return Region(name, numel, dtype, self._peer_tensors[name][self.rank])

    def get(self, region: Region, peer: int, offset: int, out: torch.Tensor) -> None:
        n = out.numel()
        self._check_range(region, peer, offset, n)
        out.view(-1).copy_(self._peer_tensors[region.name][peer][offset : offset + n])

    def accumulate(self, region: Region, peer: int, offset: int, src: torch.Tensor) -> None:
        n = src.numel()
        self._check_range(region, peer, offset, n)
        fd = self._mappings[region.name][peer].fd
        itemsize = region.dtype.itemsize
        dst = self._peer_tensors[region.name][peer][offset : offset + n]
        with self._thread_lock:
            fcntl.lockf(fd, fcntl.LOCK_EX, n * itemsize, offset * itemsize, os.SEEK_SET)
            try:
                dst.add_(src.reshape(-1))
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, n * itemsize, offset * itemsize, os.SEEK_SET)

    def barrier(self, timeout_s: float) -> None:
        # Each rank bumps its own arrival counter and polls everyone else's. Accumulates finished under
        # their lock before the bump; unlocking is a system call, so the adds are in memory before any
        # peer can see the new counter.
        self._epoch += 1
        self._arrivals.local[0] = self._epoch
        peers = self._peer_tensors["odc.barrier"]
        self.wait_for_arrivals(lambda: [r for r in range(self.world_size) if int(peers[r][0]) < self._epoch],
                               self._epoch, timeout_s)

    def close(self) -> None:
        for mappings in self._mappings.values():
            for m in mappings:
                m.close()
        self._mappings.clear()
        self._peer_tensors.clear()
