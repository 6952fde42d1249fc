"""The failure notices every transport keeps, and the errors ODC raises for its group's state.

A rank whose work fails posts a failure notice in its own slice of a region every transport
sets up (`announce_failure`); every wait of its peers reads the notices and raises ODCPeerFailedError
instead of waiting out its timeout. The ranks then meet once more (`recover`): once every rank is there,
none issues anything of the failed work any more (every earlier accumulate has landed, as at a barrier),
so each may reset what that work touched; the notices are then complete, and the ranks move to a new
*round* together. Notices and barrier epochs carry the round, so a notice of a round already recovered
from is never raised again, and a barrier never counts a peer that left its round for the recovery.

The protocol is mixed into Transport (base.py): it reads its peers' notices with the transport's own
`get`, posts with `signal`, and meets with `barrier`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class ODCError(RuntimeError):
    """Base of every error ODC raises for the state of its group of ranks (a timeout, a failed peer, a group
    left unusable by either); catching it catches them all. Misuse of the API raises ValueError or
    RuntimeError instead, and changes nothing."""


class ODCTimeoutError(ODCError):
    """A rank waited longer than the barrier timeout; names the ranks that never arrived."""


class ODCPeerFailedError(ODCError):
    """A peer announced that its mini-batch failed (`Transport.announce_failure`); names it and what it raised."""


# A failure notice: its round + 1 (0: none), when it was posted (time.time_ns(), which orders concurrent
# failures), then up to 8 * 62 bytes of its message. Each rank has two, used by alternate rounds: a rank
# already in the next round may post while a slower peer still reads the notices of the last one.
NOTICE_WORDS = 64
# A notice's header: the round it belongs to (+1), when it was posted, the last barrier its rank passed
# (written by every rank on its way to the recovery meeting, whether it posted the notice or not).
_HEADER_WORDS = 3
_PASSED_WORD = 2
# Barrier epochs: round r's barriers are (r << ROUND_SHIFT) + 1, + 2, ...; its recovery meeting is
# (r + 1) << ROUND_SHIFT, the base of the next round.
ROUND_SHIFT = 32


@dataclass(frozen=True)
class FailureNotice:
    """One rank's announcement that its part of the current round failed."""

    rank: int
    time_ns: int
    message: str


def first_failure(notices: list[FailureNotice]) -> FailureNotice:
    """The failure every rank names: the earliest posted, the lower rank on a tie."""
    return min(notices, key=lambda n: (n.time_ns, n.rank))


class FailureNotices:
    """Transport's failure notices and rounds (the module's protocol)."""

    def __init__(self) -> None:
        self._notices = None  # every transport sets them up (_alloc_failure_notices)
        self._round = 0  # failed rounds recovered from: the same on every rank between recoveries
        self._epoch = 0  # the last barrier's
        self._passed_epoch = 0  # the last barrier this rank passed
        self._recovering = False

    def _alloc_failure_notices(self) -> None:
        """Collective, at the end of every transport's set-up: the two failure notices of each rank."""
        self._notices = self._alloc_control("odc.failure", 2 * NOTICE_WORDS, torch.int64)

    @staticmethod
    def arrived(word: int, epoch: int) -> bool:
        """Whether a peer whose arrival word reads `word` has reached barrier `epoch`: at or past it within
        the same round. A peer that left the round for its recovery meeting has not, by this word alone."""
        return epoch <= word < ((epoch >> ROUND_SHIFT) + 1) << ROUND_SHIFT

    def peer_arrived(self, peer: int, word: int, epoch: int) -> bool:
        """`arrived`, and for a peer whose word shows it left for its recovery meeting, whether it had passed
        barrier `epoch` first (its notice slot says which barrier it last passed, written by every rank
        before it meets to recover): a peer may pass a barrier and fail its next step before this rank sees
        the barrier end, which its recovery word alone would hide."""
        if self.arrived(word, epoch):
            return True
        if word < ((epoch >> ROUND_SHIFT) + 1) << ROUND_SHIFT:
            return False
        passed = torch.empty(1, dtype=torch.int64, device=self._notices.local.device)
        self.get(self._notices, peer, (self._round % 2) * NOTICE_WORDS + _PASSED_WORD, passed)
        return self.arrived(int(passed.item()), epoch)  # an earlier round's is below every epoch of this one

    @staticmethod
    def barrier_name(epoch: int) -> str:
        """How errors name barrier `epoch`: "ODC barrier #3" in the first round, with its round after that."""
        round_, k = divmod(epoch, 1 << ROUND_SHIFT)
        if k == 0:
            return f"ODC recovery meeting #{round_}"
        return f"ODC barrier #{k}" + (f" of round {round_}" if round_ else "")

    def _peer_failure(self) -> ODCPeerFailedError | None:
        """What a wait raises for a peer's announced failure in the current round, or None; None in a
        recovery too, whose very point is that peers failed."""
        return None if self._recovering else self.peer_failure()

    def peer_failure(self) -> ODCPeerFailedError | None:
        """The error a peer's announced failure in the current round makes this rank raise, or None."""
        theirs = [n for n in self.failures() if n.rank != self.rank]
        if not theirs:
            return None
        first = first_failure(theirs)
        return ODCPeerFailedError(f"rank {self.rank}: rank {first.rank} failed in its mini-batch: {first.message}")

    def announce_failure(self, message: str) -> None:
        """Announce that this rank's part of the current round failed with `message`: every peer waiting,
        now or later in the round, raises ODCPeerFailedError naming this rank. The ranks then `recover`."""
        self._check_open()
        slot = (self._round % 2) * NOTICE_WORDS
        room = 8 * (NOTICE_WORDS - _HEADER_WORDS)
        text = message.encode("utf-8", errors="replace")[:room].ljust(room, b"\0")
        local = self._notices.local
        local[slot + 1] = time.time_ns()
        local[slot + _HEADER_WORDS : slot + NOTICE_WORDS] = torch.frombuffer(bytearray(text), dtype=torch.int64).to(
            local.device
        )
        # The round word last, after the rest of the notice (`signal` orders it after this rank's writes).
        self.signal(self._notices, slot, self._round + 1)

    def failures(self) -> list[FailureNotice]:
        """The failure notices of the current round, this rank's own included."""
        self._check_open()
        slot = (self._round % 2) * NOTICE_WORDS
        device = self._notices.local.device
        head = torch.empty(1, dtype=torch.int64, device=device)
        notices = []
        for peer in range(self.world_size):
            self.get(self._notices, peer, slot, head)
            if int(head.item()) != self._round + 1:
                continue
            notice = torch.empty(NOTICE_WORDS, dtype=torch.int64, device=device)
            self.get(self._notices, peer, slot, notice)
            words = notice.cpu()
            text = words[_HEADER_WORDS:].numpy().tobytes().rstrip(b"\0").decode("utf-8", errors="replace")
            notices.append(FailureNotice(peer, int(words[1]), text))
        return notices

    def raise_if_a_peer_failed(self) -> None:
        """Raise ODCPeerFailedError if a peer announced a failure in the current round."""
        if (failure := self.peer_failure()) is not None:
            raise failure

    def recover(self, timeout_s: float) -> list[FailureNotice]:
        """Collective, after a failure was announced: meet every rank, none of which issues anything of the
        failed round any more, then move to the next round. Returns the round's failure notices, complete
        (each failing rank posted its own before it came here). Raises ODCTimeoutError naming the ranks
        that did not come within `timeout_s`."""
        self._check_wait(timeout_s)
        # Before the recovery word hides it (peer_arrived); the meeting's arrival orders it before that word.
        self._notices.local[(self._round % 2) * NOTICE_WORDS + _PASSED_WORD] = self._passed_epoch
        self._epoch = ((self._round + 1) << ROUND_SHIFT) - 1
        self._recovering = True
        try:
            self.barrier(timeout_s)
        finally:
            self._recovering = False
        notices = self.failures()
        self._round += 1
        self._setup_meetings = 0
        return notices
