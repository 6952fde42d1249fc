"""verl plugin entry point: importing this module is the registration.

verl 0.9.1 imports every `verl.plugins` entry point in the middle of `import verl` and never calls it.
Nothing here may resolve verl's device platform then (a later plugin may still register one), so the
`odc` engines join verl's EngineRegistry, and the patches in `patches/` are applied, only once verl's
engine and worker modules are imported (`imports.after_import`). With VERL_PLATFORM=cpu the plugin
also makes verl run on CPU (`cpu/`).
"""

from __future__ import annotations

import odc_patches

from . import cpu
from .imports import after_import

DEVICES = ["cuda", "cpu"]


def _register_engines() -> None:
    from verl.workers.engine import EngineRegistry

    from .engine import ODCEngineWithLMHead, ODCEngineWithValueHead

    for model_type, engine_cls in (("language_model", ODCEngineWithLMHead), ("value_model", ODCEngineWithValueHead)):
        # Registering twice raises in verl; the module can be imported again after a reload.
        if EngineRegistry._engines.get(model_type, {}).get("odc") is None:
            EngineRegistry.register(model_type, "odc", device=DEVICES)(engine_cls)


if cpu.requested():
    cpu.enable(after_import)
after_import("verl.workers.engine", _register_engines)
odc_patches.apply_after_import(after_import)
