"""verl plugin entry point: importing this module is the registration.

verl 0.9.1 imports every `verl.plugins` entry point in the middle of `import verl` and never calls it.
Nothing here may resolve verl's device platform then (a later plugin may still register one), so what
the plugin does to verl waits until verl's own modules are imported (`imports.after_import`):

- the `odc` engines join verl's EngineRegistry (verl's extension point for backends);
- verl's trainer gets the choice between its own class and the odc subclass (`patches/trainer_choice.py`;
  verl's legacy trainer, the refusal of odc), which acts only on a configuration naming odc; everything odc
  needs of verl's trainer and workers comes with that subclass (odc_plugin/verl/trainer.py), so a run of
  other strategies executes verl's own code.

With VERL_PLATFORM=cpu the plugin also makes verl run on CPU (`cpu/`).

verl logs a plugin that fails to import at DEBUG level only, after which `strategy=odc` fails far from
the cause ("Unknown backend: odc"); so a failure here is logged at ERROR with its reason before verl
swallows it, and a failure of a deferred registration at WARNING, leaving runs of other strategies to start.
"""

from __future__ import annotations

import functools
import importlib
import logging

logger = logging.getLogger(__name__)
UNAVAILABLE = "strategy=odc is unavailable (verl will say 'Unknown backend: odc'); other strategies are unaffected"


def _register_engines() -> None:
    # engine.py registers its engines at its end, also when it is the module importing verl's engine package
    # (this then hands back the module being imported, and its own last line registers)
    importlib.import_module(f"{__package__}.engine")


def _warn_on_failure(what: str, callback):
    def run() -> None:
        try:
            callback()
        except Exception as e:
            logger.warning("odc_plugin: %s failed, %s: %s: %s", what, UNAVAILABLE, type(e).__name__, e)

    return run


try:
    from odc_patches import trainer_choice

    from . import cpu
    from .imports import after_import

    if cpu.requested():
        cpu.enable(after_import)
    after_import("verl.workers.engine", _warn_on_failure("registering the odc engines", _register_engines))
    for module in trainer_choice.TARGETS:
        choice = functools.partial(trainer_choice.apply, module)
        after_import(module, _warn_on_failure("odc patch 'trainer_choice'", choice))
    script_choice = _warn_on_failure("odc patch 'trainer_choice'", trainer_choice.apply_to_script)
    after_import(trainer_choice.SCRIPT_HOOK, script_choice)
except Exception as e:
    logger.error("odc_plugin: the verl plugin 'odc' failed to load, %s: %s: %s", UNAVAILABLE, type(e).__name__, e)
    raise
