"""Transports: one-sided get / accumulate over symmetric regions, chosen by name."""

from __future__ import annotations

import torch.distributed as dist

from .base import ODCTimeoutError, Region, Transport

TRANSPORTS = ("auto", "shm", "cuda_ipc", "nvshmem")


def make_transport(kind: str = "auto", group: dist.ProcessGroup | None = None) -> Transport:
    """Build the transport `kind` over `group` (collective: every rank of the group calls it)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown ODC transport '{kind}'; expected one of {', '.join(TRANSPORTS)}")
    if kind in ("auto", "shm"):
        from .shm import ShmTransport

        return ShmTransport(group)
    raise NotImplementedError(f"ODC transport '{kind}' is not built yet")


__all__ = ["ODCTimeoutError", "Region", "Transport", "TRANSPORTS", "make_transport"]
