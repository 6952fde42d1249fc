"""Per-source slots: the accumulate method that needs neither peer atomics nor locks ("slots").

An accumulator of n elements is allocated as W * n on every rank: the accumulator itself, then a slot of n
for each peer, in rank order, the owner left out. A sender adds into its own slot in the owner's memory,
which no one else writes, so a plain read-add-write is exact, over a PCIe link without native peer atomics
too; the owner adds into its accumulator alone. At the barrier, once every rank has arrived (every add has
landed), each owner folds its slots into its accumulator, always in rank order (so the sums are the same
run to run, which concurrent atomic adds are not), zeroes them, and the ranks meet once more, so that no
sender adds into a slot before it is zeroed. The price: W - 1 more copies of the accumulator, a fold and
a second meeting per barrier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Slots:
    """The slots of one accumulator region on this rank: `local` holds all of its W * numel elements."""

    numel: int
    world_size: int
    local: torch.Tensor

    @staticmethod
    def allocated_numel(numel: int, world_size: int) -> int:
        return numel * world_size

    def slot_in(self, owner_full: torch.Tensor, sender: int, owner: int) -> torch.Tensor:
        """`sender`'s slot in `owner`'s allocation of the region (`owner_full`, all of its elements)."""
        index = 1 + sender - (sender > owner)
        return owner_full[index * self.numel : (index + 1) * self.numel]

    def fold(self, keep: bool = True) -> None:
        """Add the slots into the accumulator (unless not `keep`), then zero them."""
        slots = self.local[self.numel :].view(self.world_size - 1, self.numel)
        if keep:
            accumulator = self.local[: self.numel]
            for slot in slots:
                accumulator.add_(slot)
        slots.zero_()
