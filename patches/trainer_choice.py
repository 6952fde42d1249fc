"""verl's v1 trainer is built from the class the run's configuration calls for: verl's own, or its odc
subclass.

verl 0.9.1's `main_ppo` builds the trainer in its TaskRunner as
`get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)` (`verl/trainer/main_ppo.py:150-167`),
the first point at which a process of the run holds the run's configuration. This patch gives verl's
`PPOTrainer`, which has no `__new__` of its own (object's), one that asks
`odc_plugin.verl.trainer.trainer_class(cls, config)`: a configuration without odc gets `cls` itself, its
instance made as object.__new__ makes it, and nothing more of this project runs in that trainer; a
configuration naming odc gets the odc subclass, or fails there in one line (another verl version, a
trainer mode odc does not support).

Why a patch: verl's trainer registry (`register_trainer`, `trainer_base.py:1999`) is keyed by the mode's
name alone, registering another class under a name verl registered raises, and a new name would change
`trainer.v1.trainer_mode`, which verl also reads for the mode's own settings (`trainer_base.py:130-131`,
`151`); so no extension point picks a class by the roles' strategies. Applied in every process on every
verl version: it changes nothing for a run without odc, and on a verl it cannot apply to it logs a
warning and leaves the choice to the odc engines' own check at start.
"""

from __future__ import annotations

import importlib
import logging

from odc_patches import require_attr

VERL_VERSION = "0.9.1"
NAME = "trainer_choice"
TARGET = "verl.trainer.ppo.v1.trainer_base"

logger = logging.getLogger(__name__)


def _new(cls, *args, **kwargs):
    from odc_plugin.verl.trainer import trainer_class

    config = kwargs["config"] if "config" in kwargs else (args[0] if args else None)
    return object.__new__(cls if config is None else trainer_class(cls, config))


def apply() -> None:
    try:
        trainer = require_attr(importlib.import_module(TARGET), "PPOTrainer", NAME)
    except Exception as e:  # a verl without the v1 trainer: runs of other strategies must still start
        logger.warning("odc patch '%s' not applied: %s", NAME, e)
        return
    own = vars(trainer).get("__new__")
    if own is not None:
        if getattr(own, "__func__", None) is not _new:
            logger.warning(
                "odc patch '%s' not applied: verl's PPOTrainer has a __new__ of its own now; strategy=odc needs "
                "verl %s",
                NAME,
                VERL_VERSION,
            )
        return
    trainer.__new__ = staticmethod(_new)
