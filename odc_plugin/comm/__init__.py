"""Transports: one-sided get / accumulate over symmetric regions, chosen by name."""

from __future__ import annotations

from typing import Literal, get_args

import torch.distributed as dist

from .base import DelegatingTransport, ODCError, ODCPeerFailedError, ODCTimeoutError, Region, Transport

TransportName = Literal["auto", "shm", "cuda_ipc", "nvshmem"]
TRANSPORTS: tuple[str, ...] = get_args(TransportName)


def make_transport(kind: str = "auto", group: dist.ProcessGroup | None = None, **options) -> Transport:
    """Build the transport `kind` over `group` (collective: every rank of the group calls it).

    "auto": shm on CPU; on GPUs cuda_ipc when every rank is on one node; a GPU group on several nodes is
    refused for now (flat NVSHMEM, see select.py): across nodes ODC runs as HSDP, a transport per node.
    `options` go to the GPU transports' constructors (e.g. `staging=` for nvshmem).
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown ODC transport '{kind}'; expected one of {', '.join(TRANSPORTS)}")
    if kind == "auto":
        from .select import resolve_auto

        kind = resolve_auto(group)
    if kind == "shm":
        from .shm import ShmTransport

        if options:
            raise TypeError(f"the shm transport takes no options, got {sorted(options)}")
        return ShmTransport(group)
    if kind == "cuda_ipc":
        from .cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(group, **options)
    from .nvshmem import NvshmemTransport

    return NvshmemTransport(group, **options)


__all__ = [
    "DelegatingTransport",
    "ODCError",
    "ODCPeerFailedError",
    "ODCTimeoutError",
    "Region",
    "Transport",
    "TransportName",
    "TRANSPORTS",
    "make_transport",
]
