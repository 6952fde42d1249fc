"""A `cpu` device platform for verl 0.9.1, which has none (without one it falls back to "nvidia").

Training ranks run on gloo. The Ray resource stays "GPU": verl's resource pools count accelerators, so
a CPU job declares as many Ray GPUs as it has training ranks (`ray_init.num_gpus`); no CUDA is used.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

NAME = "cpu"


def _noop(*_args, **_kwargs):
    return None


def _zero(*_args, **_kwargs):
    return 0


# What verl calls on its device module (`get_torch_device()`) that torch.cpu lacks. The module must be
# torch.cpu itself: verl compares against it (flops counter, performance logging).
_TORCH_CPU_MISSING = {
    "empty_cache": _noop,
    "memory_allocated": _zero,
    "memory_reserved": _zero,
    "max_memory_allocated": _zero,
    "max_memory_reserved": _zero,
    "reset_peak_memory_stats": _noop,
    "manual_seed": torch.manual_seed,
    "manual_seed_all": torch.manual_seed,
    "mem_get_info": lambda *_a, **_k: (0, 0),
    # checkpoints save and restore the device RNG; on CPU that is torch's own generator
    "get_rng_state": torch.get_rng_state,
    "set_rng_state": torch.set_rng_state,
}


def fill_torch_cpu() -> None:
    for name, fn in _TORCH_CPU_MISSING.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return NAME

    @property
    def vendor_name(self) -> str:
        return NAME

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # chosen only by VERL_PLATFORM=cpu, never detected

    def current_device(self):
        return NAME

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def register() -> None:
    """Make `VERL_PLATFORM=cpu` resolve to this platform (registering only: nothing is resolved here)."""
    fill_torch_cpu()
    if PlatformRegistry.get(NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=NAME)(PlatformCPU)
