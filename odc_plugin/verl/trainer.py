"""The trainer a verl run gets: verl's own class, unless the run's configuration puts a role on odc.

verl builds its v1 trainer from `trainer.v1.trainer_mode` (`patches/trainer_choice.py` asks
`trainer_class` for the class to build). A configuration whose roles are all on other strategies gets
verl's class itself, so the run executes verl's own trainer, workers and dispatch. One with
`strategy=odc` on the actor, the reference model or the critic gets the class's odc subclass
(`odc_trainer_class`), which

- plans every FSDP pass of its odc roles with LB-Mini: the actor's update and old log-probs, the
  reference log-probs, the critic's update and values (the stage methods of `patches/lb_mini_dispatch.py`);
- builds its workers from odc subclasses of verl's (`workers.py`), through the worker classes verl's
  trainer maps its roles to (`role_worker_mapping`, as verl's own separate_async trainer swaps in its
  DetachActorWorker) and the inner training worker class of verl's ActorRolloutRefWorker
  (`actor_worker_cls`, `ref_worker_cls`).

Trainer modes: `sync`, `colocate_async` and `separate_async` train under odc as under fsdp2, every FSDP
pass planned (only separate_async overrides a stage method, `_compute_old_log_prob`, around a call of
verl's; its DetachActorWorker saves and restores the odc actor with FSDP2's functions,
`patches/detach_actor.py`). A trainer registered by someone else is refused: its methods were not checked
against the plan. So is verl's legacy trainer (`trainer.use_v1=False`: `main_ppo_v0`'s RayPPOTrainer, which
`patches/trainer_choice.py` also asks): its stages hand the workers tensors, not the TransferQueue batches
LB-Mini's dispatch plans, and it has no `init` for the loss check, so odc would train there unplanned and
unchecked.

The configuration is read as verl's own code reads it where it can be: an OmegaConf config as `main_ppo`
builds it, but also a dict, a dataclass or None (a trainer built by a user's own script), so that a run
without odc gets verl's class whatever it passes.
"""

from __future__ import annotations

import functools
import sys

from .config import config_value

# The strategy keys of the roles, and which worker kind each role's odc engine runs in.
ACTOR_SIDE_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy")
CRITIC_KEY = "critic.strategy"
# verl's SFT trainers (torchrun's and Ray's), whose configuration names the engine's strategy instead
SFT_MODULES = ("verl.trainer.sft_trainer",)
# verl's trainer modes under odc
SUPPORTED_MODES = ("sync", "colocate_async", "separate_async")
# verl's legacy trainer (trainer.use_v1=False), and why odc refuses it
LEGACY_MODULE, LEGACY_CLASS = "verl.trainer.ppo.ray_trainer", "RayPPOTrainer"
LEGACY_REFUSAL = (
    "odc: trainer.use_v1=False (verl's legacy trainer, main_ppo_v0) is not supported with strategy=odc: it "
    "dispatches every stage with verl's equal split and never runs odc's loss check or LB-Mini's plan; use "
    "trainer.use_v1=True (the default) or strategy=fsdp2"
)


def odc_sides(config) -> tuple[bool, bool]:
    """(actor or reference model on odc, critic on odc and trained) for a run's configuration."""
    from verl.trainer.ppo.utils import need_critic

    actor_side = any(config_value(config, key) == "odc" for key in ACTOR_SIDE_KEYS)
    critic = config_value(config, CRITIC_KEY) == "odc" and need_critic(config)
    return actor_side, critic


def trainer_class(cls: type, config) -> type:
    """The class of a run's trainer: `cls` (verl's class for the run's mode) without odc, else its odc
    subclass (a ValueError or PatchError in one line if odc cannot train with it)."""
    if getattr(cls, "_odc_trainer", False):
        return cls
    from . import sft

    if sft.module_of(cls).startswith(SFT_MODULES):
        return sft.trainer_class(cls, config)
    if not any(odc_sides(config)):
        return cls
    return odc_trainer_class(cls)


def odc_trainer_class(cls: type) -> type:
    """The odc subclass of verl's trainer class `cls`, for a run with odc roles."""
    import odc_patches

    odc_patches.require_odc_verl()
    legacy = sys.modules.get(LEGACY_MODULE)  # cls can only be its subclass once it is imported
    if legacy is not None and issubclass(cls, getattr(legacy, LEGACY_CLASS)):
        raise ValueError(LEGACY_REFUSAL)
    # after the legacy trainer's refusal: verl's v1 trainers need TransferQueue, which its legacy one does not
    from verl.trainer.ppo.v1 import get_trainer_cls

    if not any(get_trainer_cls(mode) is cls for mode in SUPPORTED_MODES):
        raise ValueError(
            f"odc: the trainer {cls.__module__}.{cls.__qualname__} is not supported with strategy=odc, which "
            f"plans verl's own trainers of trainer.v1.trainer_mode={', '.join(SUPPORTED_MODES)} only"
        )
    return _subclass(cls)


@functools.cache
def _subclass(cls: type) -> type:
    import odc_patches

    return odc_patches.odc_subclass("trainer", cls, f"ODC{cls.__name__}", __name__, mixins=(_ODCWorkers,))


class _ODCWorkers:
    """The odc trainer's roles on odc get their workers from the odc subclasses of verl's worker classes."""

    _odc_trainer = True

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        import ray
        from verl.workers.engine_workers import TrainingWorker

        from . import workers

        actor_side, critic = odc_sides(self.config)
        for role, remote in list(self.role_worker_mapping.items()):
            cls = getattr(remote, "__ray_actor_class__", None)
            if actor_side and cls in workers.ACTOR_WORKERS:
                self.role_worker_mapping[role] = ray.remote(workers.ACTOR_WORKERS[cls])
            elif critic and cls is TrainingWorker:
                self.role_worker_mapping[role] = ray.remote(workers.ODCTrainingWorker)
