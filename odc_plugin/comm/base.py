"""The one-sided operations ODC needs, independent of FSDP.

A transport connects the ranks of one process group. Each rank owns one slice of every *symmetric
region* (the same size on every rank); any rank may read a peer's slice (`get`) or add into it
(`accumulate`) without the peer taking part. The only meeting point is `barrier`, once per mini-batch.

Set-up (`alloc`) is collective and runs outside mini-batches; `get`, `accumulate` and `barrier` never
call a collective on the process group, which is what lets ranks drift apart between barriers.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


class ODCTimeoutError(RuntimeError):
    """A rank waited longer than the barrier timeout; names the ranks that never arrived."""


class ODCPeerFailedError(RuntimeError):
    """A peer announced that its mini-batch failed (`Transport.fail`); names it and what it raised."""


# A failure notice: a count of the failures a rank announced, then up to 8 * 63 bytes of their message.
FAILURE_NOTICE_WORDS = 64


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


@dataclass(frozen=True)
class Region:
    """A symmetric region: `numel` elements of `dtype` on every rank, `local` is this rank's slice."""

    name: str
    numel: int
    dtype: torch.dtype
    local: torch.Tensor


class Transport(abc.ABC):
    """One-sided get / accumulate over symmetric regions, plus a timed barrier."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        # Transports that set up a failure notice (`_alloc_failure_notices`) let a failing rank tell its
        # peers at once; the others leave them to time out.
        self._failures: Region | None = None
        self._failures_seen = [0] * world_size

    def _alloc_failure_notices(self) -> None:
        """Collective, at set-up: one failure notice per rank (see `fail`)."""
        self._failures = self.alloc("odc.failure", FAILURE_NOTICE_WORDS, torch.int64)

    @abc.abstractmethod
    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> Region:
        """Collective: every rank allocates `numel` zeroed elements that all peers can reach."""

    @abc.abstractmethod
    def get(self, region: Region, peer: int, offset: int, out: torch.Tensor) -> None:
        """Copy `out.numel()` elements of `peer`'s slice, starting at `offset`, into `out`."""

    @abc.abstractmethod
    def accumulate(self, region: Region, peer: int, offset: int, src: torch.Tensor) -> None:
        """Add `src` into `peer`'s slice at `offset`; concurrent writers from many ranks lose nothing.

        The owner's own writes to its slice (zeroing it after a barrier) must be finished before peers
        accumulate again; the FSDP layer orders this with its "published" flag.
        """

    @abc.abstractmethod
    def barrier(self, timeout_s: float) -> None:
        """Wait until every rank arrives, with every earlier accumulate visible to its owner.

        Raises ODCTimeoutError naming the missing ranks after `timeout_s` seconds.
        """

    def wait_at_least(self, region: Region, peer: int, offset: int, value: int, timeout_s: float, what: str) -> None:
        """Wait until an int64 flag in `peer`'s slice reaches `value`; `what` names the wait in the error.

        Point-to-point: only `peer` has to have got there, nobody else.
        """
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
        last: list[int] = []

        def waiting_on() -> int | None:
            last[:] = missing()
            return last[0] if last else None

        self.wait_until(
            waiting_on,
            timeout_s,
            lambda: (
                f"rank {self.rank}: ODC barrier #{epoch} timed out after {timeout_s:g}s; rank(s) {last} did not arrive"
            ),
        )

    def wait_until(self, waiting_on: Callable[[], int | None], timeout_s: float, error: Callable[[], str]) -> None:
        """Return once `waiting_on()` is None; until then it names a peer whose flag this rank still waits
        for. Raises ODCTimeoutError(error()) after `timeout_s`, and ODCPeerFailedError as soon as a peer
        announces a failure (`fail`). Between checks the rank sleeps (here with growing pauses; a transport
        that can be woken sleeps until that peer changes a flag)."""

        def ready() -> bool:
            self.raise_if_a_peer_failed()
            return waiting_on() is None

        poll(ready, timeout_s, error)

    def fail(self, message: str) -> None:
        """Announce that this rank's mini-batch failed with `message`: every peer waiting for it, now or
        later, raises ODCPeerFailedError naming this rank and the message. A no-op on transports without
        failure notices."""
        if self._failures is None:
            return
        room = 8 * (FAILURE_NOTICE_WORDS - 1)
        text = message.encode("utf-8", errors="replace")[:room].ljust(room, b"\0")
        self._failures.local[1:] = torch.frombuffer(bytearray(text), dtype=torch.int64).to(self._failures.local.device)
        self.signal(self._failures, 0, int(self._failures.local[0]) + 1)

    def raise_if_a_peer_failed(self) -> None:
        """Raise ODCPeerFailedError for a failure a peer announced since this rank last saw one of its."""
        if self._failures is None:
            return
        notice = torch.empty(FAILURE_NOTICE_WORDS, dtype=torch.int64, device=self._failures.local.device)
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            self.get(self._failures, peer, 0, notice[:1])
            count = int(notice[0])
            if count > self._failures_seen[peer]:
                self._failures_seen[peer] = count
                self.get(self._failures, peer, 0, notice)
                message = notice[1:].cpu().numpy().tobytes().rstrip(b"\0").decode("utf-8", errors="replace")
                raise ODCPeerFailedError(f"rank {self.rank}: rank {peer} failed in its mini-batch: {message}")

    def signal(self, region: Region, offset: int, value: int) -> None:
        """Set an int64 flag in this rank's own slice, after every transfer this rank issued before it;
        peers waiting for it in wait_at_least see it."""
        self.synchronize()
        region.local[offset] = value

    def synchronize(self) -> None:
        """Wait for this rank's outstanding asynchronous transfers (no-op for synchronous transports)."""

    def close(self) -> None:
        """Release the regions; safe to call twice. Collective for some transports (nvshmem): every
        rank calls it, in the same order."""

    def _check_range(self, region: Region, peer: int, offset: int, n: int) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer {peer} out of range for world size {self.world_size}")
        if offset < 0 or offset + n > region.numel:
            raise ValueError(
                f"range [{offset}, {offset + n}) outside region '{region.name}' of {region.numel} elements"
            )
