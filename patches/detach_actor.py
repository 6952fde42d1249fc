"""separate_async under strategy=odc: verl's DetachActorWorker saves and restores the odc actor as fsdp2's.

verl 0.9.1's separate_async trainer maps the actor's role to `DetachActorWorker`
(`trainer/ppo/v1/trainer_separate_async.py`, `experimental/separation/engine_workers.py`), whose
`save_model_to_cpu` / `restore_model_from_cpu` keep the weights a parameter_sync_step cycle started from,
for the old log-probs of its later mini-batches (`_compute_old_log_prob`, `trainer_separate_async.py`).
It picks the save and restore functions by the actor's strategy name (`_get_strategy_handlers`,
`engine_workers.py`: fsdp; fsdp2 and veomni; megatron; NotImplementedError for any other) and
unpacks fsdp2's saved state by name again (`restore_model_from_cpu`).

The odc engine's module is FSDP2's (its parameters FSDP2's sharded DTensors; ODC replaces only the
collectives), so FSDP2's functions cover it: `fsdp2_sharded_save_to_cpu` copies each parameter's local shard,
`fsdp2_sharded_load_from_cpu` copies it back. ODC holds no copy of the weights between passes: its published
shards are a region built when a pass starts, filled from FSDP's sharded parameters at each mini-batch's
begin(), and released when the engine leaves the pass (odc_plugin/verl/engine.py). The restore releases
ODC's regions first (a no-op between passes), so no published copy of the replaced weights outlives it,
and the next pass publishes the restored ones.

This patch gives the odc subclass of DetachActorWorker (odc_plugin/verl/workers.py) `_get_strategy_handlers`
with FSDP2's pair for odc and `restore_model_from_cpu`, registered as verl's, that restores odc's saved
state as verl's fsdp2 branch does; other strategies get verl's methods. Why a patch: verl chooses the
functions by name inside the worker, with no registry to add a strategy to.
"""

from __future__ import annotations

import functools

from odc_patches import PatchError, parameters, require_attr

NAME = "detach_actor"
DETACH_MODULE = "verl.experimental.separation.engine_workers"
# verl's save and restore of an FSDP2 model's shards, which the odc actor's module is
HANDLERS = ("fsdp2_sharded_save_to_cpu", "fsdp2_sharded_load_from_cpu")
# what the worker's methods use; one gone means the method was rewritten and the patch must be too
_USES = {
    "_get_strategy_handlers": ("strategy", *HANDLERS),
    "save_model_to_cpu": ("cpu_saved_models", "copy_handler"),
    "restore_model_from_cpu": ("cpu_saved_models", "strategy", "restore_handler"),
}


def _check(base: type) -> None:
    import inspect

    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.utils import fsdp_utils

    for name in HANDLERS:
        require_attr(fsdp_utils, name, NAME)
    for name, uses in _USES.items():
        code = inspect.unwrap(require_attr(base, name, NAME)).__code__
        missing = [n for n in uses if n not in code.co_names]
        if missing:
            raise PatchError(
                f"odc patch '{NAME}': DetachActorWorker.{name} no longer uses {missing}; re-check the patch"
            )
    restore = base.restore_model_from_cpu
    if parameters(inspect.unwrap(restore)) != ["self", "n"]:
        raise PatchError(f"odc patch '{NAME}': DetachActorWorker.restore_model_from_cpu is no longer (self, n)")
    if (getattr(restore, MAGIC_ATTR, None) or {}).get("dispatch_mode") is not Dispatch.ONE_TO_ALL:
        raise PatchError(f"odc patch '{NAME}': DetachActorWorker.restore_model_from_cpu is no longer ONE_TO_ALL")


def extend(kind: str, base: type, members: dict) -> None:
    """The odc DetachActorWorker's save and restore (kind "actor_worker", a subclass of DetachActorWorker)."""
    if kind != "actor_worker":
        return
    import importlib

    detach = require_attr(importlib.import_module(DETACH_MODULE), "DetachActorWorker", NAME)
    if not issubclass(base, detach):
        return
    _check(base)
    handlers, restore = base._get_strategy_handlers, base.restore_model_from_cpu

    @functools.wraps(handlers)
    def _get_strategy_handlers(self):
        if self.config.actor.strategy != "odc":
            return handlers(self)
        from verl.utils import fsdp_utils

        return tuple(getattr(fsdp_utils, name) for name in HANDLERS)

    @functools.wraps(restore)  # verl's registration (ONE_TO_ALL) comes with it
    def restore_model_from_cpu(self, n):
        if self.config.actor.strategy != "odc":
            return restore(self, n)
        if n in self.cpu_saved_models:
            self.actor.engine.odc.release()
            state, spec = self.cpu_saved_models[n]
            self.restore_handler(self.actor.engine.module, state, spec)

    members["_get_strategy_handlers"] = _get_strategy_handlers
    members["restore_model_from_cpu"] = restore_model_from_cpu
