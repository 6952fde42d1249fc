"""The NVSHMEM transport's staging layout and heap sizing: pure, so computed and tested without NVSHMEM.

A remote accumulate travels as a 64-byte header and its payload in a staging slot (`pack_slot`); the
symmetric heap must hold the regions, the staging and the control words (`heap_bytes_needed`), and
NVSHMEM_SYMMETRIC_SIZE says how much it has (`heap_bytes_available`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

HEADER_BYTES = 64  # int64 fields: [0] element offset, [1] numel, [2] dtype code, [3] region id
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
HEAP_ALIGN = 512  # nvshmem_malloc granularity assumed when estimating
HEAP_RESERVE = 64 << 20  # estimate of what NVSHMEM keeps for itself in the heap
DEFAULT_HEAP_BYTES = 1 << 30  # NVSHMEM's default NVSHMEM_SYMMETRIC_SIZE

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)\s*$")
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of a size written NVSHMEM's way: a number with an optional k/m/g/t suffix (powers of 2)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read '{text}' as a size (expected e.g. 1073741824, 512M, 2G)")
    return math.ceil(float(m.group(1)) * _SCALE[m.group(2).lower()])


def heap_bytes_available(env: Mapping[str, str] = os.environ) -> int:
    raw = env.get("NVSHMEM_SYMMETRIC_SIZE")
    return DEFAULT_HEAP_BYTES if raw in (None, "") else parse_size(raw)


def aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // HEAP_ALIGN) * HEAP_ALIGN


@dataclass(frozen=True)
class StagingConfig:
    """Staging of remote accumulates: `slots` slots of `slot_bytes` per sending rank in each owner."""

    slot_bytes: int = 8 << 20
    slots: int = 2

    def __post_init__(self):
        if self.slot_bytes <= HEADER_BYTES or self.slot_bytes % HEADER_BYTES:
            raise ValueError(
                f"slot_bytes must be a multiple of {HEADER_BYTES} larger than {HEADER_BYTES}, got {self.slot_bytes}"
            )
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")

    @property
    def payload_bytes(self) -> int:
        return self.slot_bytes - HEADER_BYTES

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> StagingConfig:
        """ODC_NVSHMEM_SLOT_BYTES (a size, e.g. 8M) and ODC_NVSHMEM_SLOTS override the defaults."""
        kw = {}
        if env.get("ODC_NVSHMEM_SLOT_BYTES"):
            kw["slot_bytes"] = parse_size(env["ODC_NVSHMEM_SLOT_BYTES"])
        if env.get("ODC_NVSHMEM_SLOTS"):
            kw["slots"] = int(env["ODC_NVSHMEM_SLOTS"])
        return cls(**kw)


def control_words(world_size: int, cfg: StagingConfig) -> int:
    """int64 words: a signal per inbox slot, then credit, arrive, expect and count-out per rank."""
    return world_size * cfg.slots + 4 * world_size


def staging_bytes(world_size: int, cfg: StagingConfig) -> int:
    """Inbox (every sender's slots), one outbox slot and one get bounce buffer."""
    return (world_size * cfg.slots + 2) * cfg.slot_bytes


def heap_bytes_needed(region_nbytes: Iterable[int], world_size: int, cfg: StagingConfig) -> int:
    """Symmetric heap per GPU for these regions plus the staging (an estimate, with NVSHMEM's reserve)."""
    total = HEAP_RESERVE + aligned(staging_bytes(world_size, cfg)) + aligned(8 * control_words(world_size, cfg))
    return total + sum(aligned(n) for n in region_nbytes)


def heap_too_small_message(needed: int, available: int, what: str) -> str:
    """`needed` counts everything this transport holds so far plus `what`; later regions add to it, so the
    suggestion rounds up to whole GiB."""
    suggest = f"{-(-needed // (1 << 30))}G"
    return (
        f"NVSHMEM symmetric heap too small for {what}: ODC needs at least {needed} bytes "
        f"({needed / (1 << 30):.2f} GiB) per GPU but NVSHMEM_SYMMETRIC_SIZE gives {available} bytes "
        f"({available / (1 << 30):.2f} GiB). Set NVSHMEM_SYMMETRIC_SIZE={suggest} or more in every rank's "
        "environment before it starts (staging can be shrunk with ODC_NVSHMEM_SLOT_BYTES / ODC_NVSHMEM_SLOTS)"
    )


def payload_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16 travels as bf16 (half the bytes); anything else is converted to fp32 while packing."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def pack_slot(slot: torch.Tensor, offset: int, src: torch.Tensor, region_id: int) -> int:
    """Write header and payload for `accumulate(region_id, offset, src)` into the uint8 `slot`.

    Enqueued on the current stream when `slot` is on a GPU. Returns how many bytes of the slot to put.
    """
    dtype = payload_dtype(src.dtype)
    m = src.numel()
    nbytes = HEADER_BYTES + m * dtype.itemsize
    if nbytes > slot.numel():
        raise ValueError(f"{m} elements of {dtype} do not fit a slot of {slot.numel()} bytes")
    header = torch.tensor(
        [offset, m, DTYPE_CODES[dtype], region_id, 0, 0, 0, 0], dtype=torch.int64, pin_memory=slot.is_cuda
    )
    # Pinned source + non_blocking: torch's host allocator keeps `header` alive until the copy ran.
    slot[:HEADER_BYTES].view(torch.int64).copy_(header, non_blocking=slot.is_cuda)
    slot[HEADER_BYTES:nbytes].view(dtype).copy_(src.reshape(-1))
    return nbytes
