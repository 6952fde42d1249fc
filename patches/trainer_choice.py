"""verl's trainer is built from the class the run's configuration calls for: verl's own, or its odc
subclass; and verl's legacy trainer refuses odc.

verl 0.9.1's `main_ppo` builds the v1 trainer in its TaskRunner as
`get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)` (`verl/trainer/main_ppo.py`),
and with `trainer.use_v1=False` the legacy one as `RayPPOTrainer(config=config, ...)`
(`verl/trainer/main_ppo_v0.py`): the first point at which a process of the run holds the run's
configuration. This patch gives verl's `PPOTrainer` and `RayPPOTrainer` (`TARGETS`), which have no
`__new__` of their own or in their bases (object's), one that asks
`odc_plugin.verl.trainer.trainer_class(cls, config)`: a configuration without odc gets `cls` itself, its
instance made as object.__new__ makes it, and nothing more of this project runs in that trainer; a
configuration naming odc gets the odc subclass, or fails there in one line (another verl version, a
trainer mode odc does not support, the legacy trainer).

Why a patch: verl's trainer registry (`register_trainer`, `trainer_base.py`) is keyed by the mode's
name alone, registering another class under a name verl registered raises, and a new name would change
`trainer.v1.trainer_mode`, which verl also reads for the mode's own settings (`trainer_base.py`,
`151`); so no extension point picks a class by the roles' strategies, and none sees the legacy trainer's
configuration. Applied in every process on every verl version: it changes nothing for a run without odc,
and on a verl it cannot apply to (the class gone, or a `__new__` verl defines in the class or any of its
bases, which this one would hide or be hidden by) it logs one warning line and leaves the choice to the
odc engines' own check at start.
"""

from __future__ import annotations

import importlib
import logging
import sys

from odc_patches import PATCHED_VERL_VERSION, replace_attr, require_attr

NAME = "trainer_choice"
# where apply_to_script hooks in
SCRIPT_HOOK = "verl.utils.device"
# module -> the trainer class in it that gets the choice: the v1 trainers' base, the legacy trainer, the SFT trainers
TARGETS = {
    "verl.trainer.ppo.v1.trainer_base": "PPOTrainer",
    "verl.trainer.ppo.ray_trainer": "RayPPOTrainer",
    "verl.trainer.sft_trainer": "SFTTrainer",
    "verl.trainer.sft_trainer_ray": "SFTTrainer",
}

logger = logging.getLogger(__name__)


def _new(cls, *args, **kwargs):
    from odc_plugin.verl.trainer import trainer_class

    config = kwargs["config"] if "config" in kwargs else (args[0] if args else None)
    return object.__new__(trainer_class(cls, config))


def give_choice(trainer: type) -> None:
    """Give verl's trainer class `trainer` the `__new__` that chooses, unless it or a base defines one."""
    owner = next((k for k in trainer.__mro__[:-1] if "__new__" in vars(k)), None)
    if owner is None:
        trainer.__new__ = staticmethod(_new)
    elif owner is not trainer or getattr(vars(trainer)["__new__"], "__func__", None) is not _new:
        logger.warning(
            "odc patch '%s' not applied: verl's %s has a __new__ of its own now (defined by %s); strategy=odc needs "
            "verl %s",
            NAME,
            trainer.__qualname__,
            owner.__qualname__,
            PATCHED_VERL_VERSION,
        )


def apply(module: str) -> None:
    """The choice for the trainer class of `module` (one of TARGETS), once that module is imported."""
    try:
        trainer = require_attr(importlib.import_module(module), TARGETS[module], NAME)
    except Exception as e:  # a verl without this trainer: runs of other strategies must still start
        logger.warning("odc patch '%s' not applied: %s", NAME, e)
        return
    give_choice(trainer)


def apply_to_script() -> None:
    """The choice for the trainer class of a TARGETS module run as a script (`python -m`, `torchrun -m`): its
    classes live in `__main__`, which no import hook sees. verl's SFT trainers call verl's
    `auto_set_device(config)` first thing in their `main`, before building the trainer; in such a process
    alone it is wrapped to give `__main__`'s trainer class the choice, then do what verl's does. Any other
    process (main_ppo's driver, Ray's workers) keeps verl's function. The script is read off the command
    line: `python -m` imports the script's packages, verl among them, before `__main__` is the script."""
    argv = getattr(sys, "orig_argv", [])
    name = next((argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "-m"), None)
    if name not in TARGETS:
        return
    from verl.utils import device

    def choice_first(current):
        def auto_set_device(*args, **kwargs):
            script = sys.modules["__main__"]
            if hasattr(script, TARGETS[name]):
                give_choice(getattr(script, TARGETS[name]))
            return current(*args, **kwargs)

        return auto_set_device

    replace_attr(device, "auto_set_device", NAME, choice_first)
