"""What odc-check reports of the machine: versions, devices and how the GPUs are linked, as the driver says."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess

import torch


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def gpu_links() -> list[str]:
    """`nvidia-smi topo -m`'s matrix (NV# for NVLink, PIX/PXB/PHB/NODE/SYS for PCIe paths), as it prints it;
    empty where nvidia-smi is missing."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    # nvidia-smi underlines the header with terminal escapes even into a pipe
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip() for line in out.stdout.splitlines()]
    # the matrix ends where the legend starts
    return [line for line in lines[: next((i for i, line in enumerate(lines) if not line.strip()), len(lines))]]


def environment() -> dict:
    """Versions and devices of this process's machine."""
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": nccl,
        "triton": _version("triton"),
        "verl": _version("verl"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "gpu_links": gpu_links() if cuda else [],
    }
