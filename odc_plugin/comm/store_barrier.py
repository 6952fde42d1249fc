"""A timed barrier over the c10d key-value store, for ranks that share no transport.

A transport's barrier reaches only the ranks whose memory it maps (one node). Ranks on different nodes
still have to meet once per mini-batch before their gradients are all-reduced; doing that inside the
all-reduce would let one dead rank hang every other rank until the process group's own timeout, with
an error that does not say who. Every torch.distributed job already has a key-value store (the TCPStore
at MASTER_ADDR), reachable from every node, so ranks meet there instead: each marks its arrival, and the
first rank to decide the barrier's outcome (the last arrival: passed; a rank whose wait timed out: the
ranks still missing) writes it once with compare-and-set, so every rank takes the same decision and a
late arrival fails instead of passing a barrier its peers gave up on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from .base import ODCTimeoutError

_PASSED = "ok"


def job_store() -> dist.Store:
    """The job's key-value store: a new client of the TCPStore at MASTER_ADDR:MASTER_PORT, which
    init_process_group's env:// rendezvous (verl's, torchrun's, run_ranks') connected to, through public
    API. torch has no public accessor for the store a process group was built on, so a job rendezvoused
    otherwise (tcp://, file://) gets that store through the private one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300), wait_for_workers=False)
    return dist.distributed_c10d._get_default_store()


class StoreBarrier:
    """A barrier of the global ranks `ranks` (this process is `rank`), named `name` in the store.

    `name` must be the same on every rank and unique among the barriers that share the store.
    """

    def __init__(self, ranks: Sequence[int], rank: int, name: str, store: dist.Store | None = None):
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not one of the barrier's ranks {list(ranks)}")
        self.ranks, self.rank = list(ranks), rank
        self.store = store if store is not None else job_store()
        self.prefix = f"odc-barrier/{name}"
        self._epoch = 0

    def wait(self, timeout_s: float) -> None:
        """Return once every rank has called `wait` as often as this one; else raise ODCTimeoutError
        naming the ranks that did not arrive within `timeout_s` seconds."""
        self._epoch += 1
        epoch, key = self._epoch, f"{self.prefix}/{self._epoch}"
        outcome = f"{key}/outcome"
        try:
            self.store.set(f"{key}/r{self.rank}", "")
            if self.store.add(f"{key}/arrived", 1) == len(self.ranks):
                self.store.compare_set(outcome, "", _PASSED)
            try:
                self.store.wait([outcome], timedelta(seconds=timeout_s))
                decided = self.store.get(outcome).decode()
            except dist.DistStoreError:
                missing = [r for r in self.ranks if not self.store.check([f"{key}/r{r}"])]
                # Nobody missing: the last arrival is about to write "passed", and that is the right call.
                mine = (
                    (
                        f"rank {self.rank}: ODC barrier #{epoch} timed out after {timeout_s:g}s; rank(s) {missing} "
                        f"did not arrive"
                    )
                    if missing
                    else _PASSED
                )
                decided = self.store.compare_set(outcome, "", mine).decode()
            if decided == _PASSED:
                self._forget(epoch - 1)
        except dist.DistError as e:
            raise RuntimeError(
                f"rank {self.rank}: ODC barrier #{epoch}: the c10d store failed (its host, the "
                f"process at MASTER_ADDR, may have died): {e}"
            ) from e
        if decided == _PASSED:
            return
        if not decided.startswith(f"rank {self.rank}:"):
            decided = f"rank {self.rank}: ODC barrier #{epoch} failed: {decided}"
        raise ODCTimeoutError(decided)

    def _forget(self, epoch: int) -> None:
        """Drop the keys of barrier `epoch`: once the next one has passed, every rank has read its outcome."""
        if epoch < 1:
            return
        key = f"{self.prefix}/{epoch}"
        self.store.delete_key(f"{key}/r{self.rank}")
        if self.rank == self.ranks[0]:
            self.store.delete_key(f"{key}/arrived")
            self.store.delete_key(f"{key}/outcome")
