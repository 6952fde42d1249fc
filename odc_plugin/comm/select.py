"""Which transport "auto" picks: a pure function of where the ranks run, testable without a GPU.

CPU tensors use shared memory, which only reaches ranks on the same machine. On GPUs a peer on the
same node is reachable by CUDA IPC (loads, stores and atomics straight into its memory); a peer on
another node only through NVSHMEM. One transport serves the whole group, so a group that spans nodes
would use NVSHMEM for every peer (NVSHMEM itself takes the NVLink path for same-node peers). That flat
layout is refused (`flat_nvshmem_error`): across nodes ODC runs as HSDP, one group per node.
"""

from __future__ import annotations

from collections.abc import Sequence

DEVICE_TYPES = ("cpu", "cuda")


def peer_transports(hostnames: Sequence[str], rank: int, device_type: str) -> list[str]:
    """For each rank of the group, the transport that `rank` would reach it with (itself included)."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type '{device_type}' has no ODC transport; expected one of {', '.join(DEVICE_TYPES)}")
    if not 0 <= rank < len(hostnames):
        raise ValueError(f"rank {rank} out of range for {len(hostnames)} hostnames")
    mine = hostnames[rank]
    if device_type == "cpu":
        return ["shm" if host == mine else "none" for host in hostnames]
    return ["cuda_ipc" if host == mine else "nvshmem" for host in hostnames]


def flat_nvshmem_error(hostnames: Sequence[str]) -> str | None:
    """Why one NVSHMEM transport over ranks on several nodes is refused (one line), or None on one node.

    It has only run with one PE, and its accumulates progress only when the owner's host calls the
    transport (host-side folds and credits), which puts ranks back into lockstep at every layer. The
    refusal stays until it progresses on the GPU and has been measured with more than one PE.
    """
    hosts = sorted(set(hostnames))
    if len(hosts) < 2:
        return None
    named = ", ".join(hosts[:4]) + (f" and {len(hosts) - 4} more" if len(hosts) > 4 else "")
    return (
        f"flat ODC across nodes is not offered: one NVSHMEM transport over ranks on {len(hosts)} nodes ({named}) "
        "has never run with more than one PE and drives its accumulates from the host; set fsdp_size to the "
        "GPUs per node (HSDP: ODC inside each node, one all-reduce across nodes per mini-batch)"
    )


def choose_transport(hostnames: Sequence[str], device_type: str) -> str:
    """The one transport for the whole group: the same answer on every rank, given the same inputs.
    A GPU group on several nodes gets flat_nvshmem_error's ValueError."""
    if not hostnames:
        raise ValueError("no ranks given")
    kinds = {k for rank in range(len(hostnames)) for k in peer_transports(hostnames, rank, device_type)}
    if device_type == "cpu":
        if "none" in kinds:
            hosts = sorted(set(hostnames))
            raise ValueError(f"ODC on CPU needs every rank on one machine (shared memory); the group spans {hosts}")
        return "shm"
    if "nvshmem" in kinds:
        raise ValueError(flat_nvshmem_error(hostnames))
    return "cuda_ipc"


def group_device_type(group=None) -> str:
    """ "cuda" when this process trains on GPUs (CUDA present and the group runs NCCL), else "cpu"."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "cpu"
    return "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"


def resolve_auto(group=None) -> str:
    """What make_transport("auto") builds over `group` (collective on GPU: the ranks swap hostnames)."""
    import socket

    import torch.distributed as dist

    device_type = group_device_type(group)
    if device_type == "cpu":
        return "shm"  # without a collective, as before; shm itself fails clearly across machines
    hostnames: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hostnames, socket.gethostname(), group=group)
    return choose_transport(hostnames, device_type)
