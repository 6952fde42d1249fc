"""Transports: one-sided get / accumulate over symmetric regions, chosen by name."""

from __future__ import annotations

from typing import Literal, get_args

import torch.distributed as dist

from .base import ACCUMULATE_METHODS, AccumulateMethod, DelegatingTransport, Region, Transport
from .failure import ODCError, ODCPeerFailedError, ODCTimeoutError

TransportName = Literal["auto", "shm", "cuda_ipc", "nvshmem"]
TRANSPORTS: tuple[str, ...] = get_args(TransportName)
AccumulateChoice = Literal["auto", AccumulateMethod]
ACCUMULATE_CHOICES: tuple[str, ...] = get_args(AccumulateChoice)


def make_transport(
    kind: str = "auto", group: dist.ProcessGroup | None = None, accumulate: str = "auto", **options
) -> Transport:
    """Build the transport `kind` over `group` (collective: every rank of the group calls it).

    "auto": shm on CPU; on GPUs cuda_ipc when every rank is on one node; a GPU group on several nodes is
    refused (flat NVSHMEM, see select.py): across nodes ODC runs as HSDP, a transport per node.
    `accumulate`: the accumulate method (base.ACCUMULATE_METHODS) or "auto": "direct" where it is exact
    (cuda_ipc checks its peer atomics at start and falls back to "slots"), until a calibration
    (calibrate.py) picks the faster; nvshmem has its own. `options` go to the GPU transports' constructors
    (e.g. `staging=` for nvshmem).
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown ODC transport '{kind}'; expected one of {', '.join(TRANSPORTS)}")
    if accumulate not in ACCUMULATE_CHOICES:
        raise ValueError(f"unknown accumulate method '{accumulate}'; expected one of {', '.join(ACCUMULATE_CHOICES)}")
    if kind == "auto":
        from .select import resolve_auto

        kind = resolve_auto(group)
    if kind == "shm":
        from .shm import ShmTransport

        if options:
            raise TypeError(f"the shm transport takes no options, got {sorted(options)}")
        transport = ShmTransport(group)
        if accumulate != "auto":
            transport.set_accumulate_method(accumulate)
        return transport
    if kind == "cuda_ipc":
        from .cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(group, accumulate=accumulate, **options)
    if accumulate != "auto":
        raise ValueError(
            f"the nvshmem transport adds through staging of its own; accumulate must be 'auto', not '{accumulate}'"
        )
    from .nvshmem import NvshmemTransport

    return NvshmemTransport(group, **options)


__all__ = [
    "AccumulateChoice",
    "ACCUMULATE_CHOICES",
    "ACCUMULATE_METHODS",
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
