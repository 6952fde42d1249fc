"""On CPU, verl's save of an FSDP2 model's shards is a copy, as it is on a GPU.

verl 0.9.1's separate_async trainer keeps the weights a parameter_sync_step cycle started from, for the
old log-probs of its later mini-batches, with `fsdp2_sharded_save_to_cpu` (`verl/utils/fsdp_utils.py`,
through `DetachActorWorker.save_model_to_cpu`), which takes each parameter's local shard
`.detach().cpu()`: a copy from a GPU, but on CPU the shard itself. The optimizer then updates the "saved"
weights in place, and restoring them (`fsdp2_sharded_load_from_cpu`) copies the current weights onto
themselves: every later mini-batch's old log-probs came from the current weights, under fsdp2 and odc alike.

With `VERL_PLATFORM=cpu` this patch makes the saved shards copies of their own. GPU runs keep verl's function.
"""

from __future__ import annotations

from odc_patches import PatchError, replace_attr

NAME = "cpu_sharded_save"
TARGET = "verl.utils.fsdp_utils"


def apply() -> None:
    import importlib

    def copied_shards(save):
        if "cpu" not in save.__code__.co_names or "_local_tensor" not in save.__code__.co_names:
            raise PatchError(
                f"odc patch '{NAME}': fsdp2_sharded_save_to_cpu no longer takes the local shards .cpu(); re-check "
                f"whether CPU still needs this patch"
            )

        def fsdp2_sharded_save_to_cpu(model):
            shards, spec = save(model)
            return {name: (tensor.clone(), shard_spec) for name, (tensor, shard_spec) in shards.items()}, spec

        return fsdp2_sharded_save_to_cpu

    replace_attr(importlib.import_module(TARGET), "fsdp2_sharded_save_to_cpu", NAME, copied_shards)
