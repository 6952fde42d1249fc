"""How the GPU transports' element-wise kernels cut a transfer into tiles and programs (pure, no Triton).

A kernel launch gets a bounded grid: at most `max_programs` programs (tens, as NCCL uses a few dozen
thread blocks), each looping over tiles with a stride of the grid, instead of one program per tile. On
FSDP's high-priority reduce-scatter stream an unbounded grid (tens of thousands of programs for a large
layer's shard) takes every SM until it drains, so the backward compute waits; a bounded grid leaves
the other SMs to it.

Every sender starts at its own tile: sender s of S begins at tile s * tiles // S and wraps around, so
S ranks adding into one owner's shard at the same time work on S different regions of it instead of
all racing through the same addresses from offset 0.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE = 4096  # elements one program handles per loop round (256 threads x 16 contiguous elements)
# Default bound of the grid (an H100 has 132 SMs): by docs/gpu.md's rule, the bound that comes closest to
# the old kernel's accumulate rate on H100 and H200 while a matmul beside it keeps most of its throughput
# (the measurements: docs/results.md).
PROGRAMS = 96


@dataclass(frozen=True)
class TilePlan:
    """One launch: `programs` programs walk `tiles` tiles, `rounds` each, sender's walk starting at `first`."""

    tiles: int
    programs: int
    rounds: int
    first: int


def plan_tiles(
    numel: int, sender: int = 0, senders: int = 1, max_programs: int = PROGRAMS, tile: int = TILE
) -> TilePlan:
    """The launch for `numel` elements sent by `sender` (0-based) of `senders` ranks writing the same range."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if not 0 <= sender < senders:
        raise ValueError(f"sender {sender} out of range for {senders} sender(s)")
    if max_programs < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    tiles = -(-numel // tile)
    programs = max(1, min(max_programs, tiles))
    return TilePlan(tiles=tiles, programs=programs, rounds=-(-tiles // programs), first=sender * tiles // senders)
