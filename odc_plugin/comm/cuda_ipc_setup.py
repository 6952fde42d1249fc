"""What the cuda_ipc transport needs of the processes it runs in, decided from what every rank reports.

Pure functions of the ranks' reports (host, GPUs, allocator settings; `ProcessGpus.here` takes one),
so the decisions are tested without a GPU; the transport gathers the reports once, when it starts, and
every rank reaches the same decision from the same reports.

- One node: CUDA IPC maps memory of the same machine only.
- Ray gives each worker one GPU (it sets CUDA_VISIBLE_DEVICES, verl's default). CUDA still opens IPC
  handles of GPUs a process does not see, so the transport maps such peers as any other; where the
  driver refuses (no peer access between those GPUs), the error names the setting that makes Ray leave
  CUDA_VISIBLE_DEVICES alone, RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES.
- torch's allocator with expandable_segments shares memory between processes only through
  pidfd_getfd, which unprivileged containers refuse: refused at start, naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Where torch reads its allocator settings from (PYTORCH_CUDA_ALLOC_CONF is the older name).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
RAY_NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class ProcessGpus:
    """One rank's report: where it runs and what its process sees."""

    host: str
    gpu: str  # UUID of the GPU the rank runs on
    visible: tuple[str, ...]  # UUIDs of every GPU the process sees
    cuda_visible_devices: str | None  # the process's CUDA_VISIBLE_DEVICES, None when unset
    alloc_conf: tuple[tuple[str, str], ...]  # (variable, value) of the allocator settings that are set

    @classmethod
    def here(cls, device_index: int, env: Mapping[str, str] = os.environ) -> ProcessGpus:
        import socket

        import torch

        def uuid(index: int) -> str:
            return str(torch.cuda.get_device_properties(index).uuid)

        return cls(
            host=socket.gethostname(),
            gpu=uuid(device_index),
            visible=tuple(uuid(i) for i in range(torch.cuda.device_count())),
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            alloc_conf=tuple((var, env[var]) for var in ALLOC_CONF_VARS if env.get(var)),
        )


def expandable_segments_on(conf: str) -> bool:
    """Whether an allocator settings string (`key:value,...`) turns expandable_segments on (the last
    mention wins, as torch parses it)."""
    on = False
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"
    return on


def setup_error(ranks: Sequence[ProcessGpus]) -> str | None:
    """The one-line error that stops every rank before anything is allocated, or None."""
    hosts = sorted({r.host for r in ranks})
    if len(hosts) > 1:
        return (
            f"the cuda_ipc transport needs every rank on one node, got {hosts}; across nodes set fsdp_size to "
            "the GPUs per node (HSDP: ODC inside each node, one all-reduce across nodes per mini-batch)"
        )
    for rank, report in enumerate(ranks):
        for var, value in report.alloc_conf:
            if expandable_segments_on(value):
                return (
                    f"cuda_ipc: rank {rank} runs with {var}={value!r}: torch shares memory of expandable_segments "
                    "between processes only through pidfd_getfd, which unprivileged containers refuse; set "
                    f"expandable_segments:False (or leave it out) in {var} of the training processes, or use the "
                    "'nvshmem' transport"
                )
    return None


def hidden_peers(ranks: Sequence[ProcessGpus], rank: int) -> list[int]:
    """The peers whose GPU `rank`'s process does not see (Ray's one GPU per worker): their handles are
    still opened, as CUDA allows; a refusal is explained by `open_error`."""
    return [peer for peer, report in enumerate(ranks) if report.gpu not in ranks[rank].visible]


def first_line(error: str) -> str:
    """The first line of an error message (torch's CUDA errors add lines of advice)."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


def open_error(ranks: Sequence[ProcessGpus], rank: int, peer: int, region: str, cause: str) -> str:
    """One line for a peer's region that `rank` could not map; `cause` is the driver's error."""
    what = f"cuda_ipc: rank {rank} cannot map rank {peer}'s region '{region}' ({first_line(cause)})"
    if peer in hidden_peers(ranks, rank):
        visible = ranks[rank].cuda_visible_devices
        return (
            f"{what}: rank {peer}'s GPU is not visible to rank {rank}'s process (CUDA_VISIBLE_DEVICES={visible}, "
            f"one GPU per worker as Ray sets it) and the driver refused to map its memory; set {RAY_NOSET}=1 "
            "where Ray starts (ray start, or the job's runtime environment) so that every worker sees every GPU "
            "of its node, or use the 'nvshmem' transport"
        )
    return f"{what}: the GPUs of the node must support peer access between them; otherwise use the 'nvshmem' transport"
