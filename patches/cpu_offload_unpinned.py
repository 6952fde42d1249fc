"""On CPU, forward-only FSDP2 engines offload to unpinned memory.

verl 0.9.1 gives every forward-only engine (the reference model) `CPUOffloadPolicy(pin_memory=True)`
(`verl/workers/engine/fsdp/transformer_impl.py:462`); pinning needs an accelerator. This patch
replaces the module's `CPUOffloadPolicy` with one that never pins. Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

import functools

from odc_patches import PatchError, require_attr, require_verl_version

VERL_VERSION = "0.9.1"
NAME = "cpu_offload_unpinned"
TARGET = "verl.workers.engine.fsdp.transformer_impl"


def apply() -> None:
    require_verl_version(NAME, VERL_VERSION)
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    current = require_attr(transformer_impl, "CPUOffloadPolicy", NAME)
    if getattr(current, "_odc_patched", False):
        return
    if current is not CPUOffloadPolicy:
        raise PatchError(f"odc patch '{NAME}': transformer_impl.CPUOffloadPolicy is not torch's any more")

    @functools.wraps(CPUOffloadPolicy, updated=())
    def unpinned(pin_memory: bool = True):
        return CPUOffloadPolicy(pin_memory=False)

    unpinned._odc_patched = True
    transformer_impl.CPUOffloadPolicy = unpinned
