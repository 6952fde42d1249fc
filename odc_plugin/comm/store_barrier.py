"""A timed barrier over the c10d key-value store, for ranks that share no transport.

A transport's barrier reaches only the ranks whose memory it maps (one node). Ranks on different nodes
still have to meet once per mini-batch before their gradients are all-reduced; doing that inside the
all-reduce would let one dead rank hang every other rank until the process group's own timeout, with
an error that does not say who. Every torch.distributed job already has a key-value store (the TCPStore
at MASTER_ADDR), reachable from every node, so ranks meet there instead: each marks its arrival, and the
first rank to decide the barrier's outcome (the last arrival: passed; a rank whose wait timed out: the
ranks still missing; a rank whose own work failed: failed) writes it once with compare-and-set, so every
rank takes the same decision and a late arrival fails instead of passing a barrier its peers gave up on.

Failures cross nodes the same way as a transport's notices cross one node (comm/base.py): a failing rank
posts its notice in the store and fails the barrier its peers wait at next; after the failure every rank
meets once more (`recover`), which makes the round's notices complete, and the barrier's keys move to a
new round.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from .failure import FailureNotice, ODCPeerFailedError, ODCTimeoutError, first_failure

_PASSED = "ok"
_FAILED = "failed"


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
        self._round = 0  # failures recovered from, as a transport counts them
        self._epoch = 0
        self._stale: list[str] = []  # keys every rank is done with once the next barrier has passed

    def _key(self, epoch: int | str) -> str:
        return f"{self.prefix}/{self._round}/{epoch}"

    def wait(self, timeout_s: float) -> None:
        """Return once every rank has called `wait` as often as this one; else raise ODCTimeoutError
        naming the ranks that did not arrive within `timeout_s` seconds, or ODCPeerFailedError naming a
        rank that announced a failure."""
        self._epoch += 1
        key = self._key(self._epoch)
        what = f"ODC barrier #{self._epoch}" + (f" of round {self._round}" if self._round else "")
        with self._store_errors(what):
            decided = self._meet(key, timeout_s, what)
            if decided == _PASSED:
                self._forget(key)
                return
            if decided == _FAILED:
                first = first_failure(self._failures())
                raise ODCPeerFailedError(
                    f"rank {self.rank}: rank {first.rank} failed in its mini-batch: {first.message}"
                )
        if not decided.startswith(f"rank {self.rank}:"):
            decided = f"rank {self.rank}: {what} failed: {decided}"
        raise ODCTimeoutError(decided)

    def announce_failure(self, message: str) -> None:
        """Post this rank's failure notice for the current round and fail the barrier its peers wait at
        next (the one this rank would have come to), so that they raise ODCPeerFailedError at once."""
        with self._store_errors("announcing a failure"):
            self.store.set(self._key(f"failed/{self.rank}"), f"{time.time_ns()} {message}")
            self.store.compare_set(f"{self._key(self._epoch + 1)}/outcome", "", _FAILED)

    def recover(self, timeout_s: float) -> list[FailureNotice]:
        """Collective, after a failure: meet every rank once more (each has posted its own notice, if it
        failed, before it came), then move to the next round. Returns the round's notices, complete."""
        key, what = self._key("recovery"), f"ODC recovery meeting #{self._round + 1}"
        with self._store_errors(what):
            decided = self._meet(key, timeout_s, what)
            if decided != _PASSED:
                raise ODCTimeoutError(decided)
            notices = self._failures()
        # The failed barrier, the notices and the meeting: every rank has read them once the next passes.
        self._stale += [
            *(f"{self._key(self._epoch + k)}/{part}" for k in (0, 1) for part in ("arrived", "outcome")),
            *(f"{self._key(e)}/r{r}" for e in (self._epoch, self._epoch + 1) for r in self.ranks),
            *(self._key(f"failed/{r}") for r in self.ranks),
            f"{key}/arrived",
            f"{key}/outcome",
            *(f"{key}/r{r}" for r in self.ranks),
        ]
        self._round += 1
        self._epoch = 0
        return notices

    def _meet(self, key: str, timeout_s: float, what: str) -> str:
        """Arrive at `key` and return its outcome: passed, failed, or the timeout message of the rank that
        decided it (the caller turns a failing store into one clear error)."""
        outcome = f"{key}/outcome"
        self.store.set(f"{key}/r{self.rank}", "")
        if self.store.add(f"{key}/arrived", 1) == len(self.ranks):
            self.store.compare_set(outcome, "", _PASSED)
        try:
            self.store.wait([outcome], timedelta(seconds=timeout_s))
            return self.store.get(outcome).decode()
        except dist.DistStoreError:
            missing = [r for r in self.ranks if not self.store.check([f"{key}/r{r}"])]
            # Nobody missing: the last arrival is about to write "passed", and that is the right call.
            mine = (
                f"rank {self.rank}: {what} timed out after {timeout_s:g}s; rank(s) {missing} did not arrive"
                if missing
                else _PASSED
            )
            return self.store.compare_set(outcome, "", mine).decode()

    def _failures(self) -> list[FailureNotice]:
        notices = []
        for r in self.ranks:
            key = self._key(f"failed/{r}")
            if self.store.check([key]):
                stamp, message = self.store.get(key).decode().split(" ", 1)
                notices.append(FailureNotice(r, int(stamp), message))
        return notices

    def _forget(self, key: str) -> None:
        """Drop the keys of the barrier before `key` (and of any recovery before it): once `key` has
        passed, every rank has read their outcome."""
        mine, shared = [k for k in self._stale if k.endswith(f"/r{self.rank}")], self._stale
        for k in mine if self.rank != self.ranks[0] else shared:
            self.store.delete_key(k)
        self._stale = [f"{key}/r{self.rank}", f"{key}/arrived", f"{key}/outcome"]

    @contextlib.contextmanager
    def _store_errors(self, what: str):
        """A failing store (its host, the process at MASTER_ADDR, died) as one error that says so."""
        try:
            yield
        except dist.DistError as e:
            raise RuntimeError(
                f"rank {self.rank}: {what}: the c10d store failed (its host, the process at MASTER_ADDR, "
                f"may have died): {e}"
            ) from e
