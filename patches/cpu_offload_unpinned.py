"""On CPU, forward-only FSDP2 engines offload to unpinned memory.

verl 0.9.1 gives every forward-only engine (the reference model) `CPUOffloadPolicy(pin_memory=True)`
(`verl/workers/engine/fsdp/transformer_impl.py`); pinning needs an accelerator. This patch
replaces the module's `CPUOffloadPolicy` with one that never pins. Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

from odc_patches import PatchError, replace_attr

NAME = "cpu_offload_unpinned"
TARGET = "verl.workers.engine.fsdp.transformer_impl"


def apply() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    def unpinned_policy(current):
        if current is not CPUOffloadPolicy:
            raise PatchError(f"odc patch '{NAME}': transformer_impl.CPUOffloadPolicy is not torch's any more")

        def unpinned(pin_memory: bool = True):
            return CPUOffloadPolicy(pin_memory=False)

        return unpinned

    replace_attr(transformer_impl, "CPUOffloadPolicy", NAME, unpinned_policy)
