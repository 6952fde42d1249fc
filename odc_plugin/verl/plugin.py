"""verl plugin entry point: importing this module is the registration.

verl 0.9.1 imports every `verl.plugins` entry point at the end of `import verl` and never calls it, so
everything happens at import: the `odc` engines join verl's EngineRegistry and the patches in
`patches/` are applied.
"""

from __future__ import annotations

from verl.workers.engine import EngineRegistry

import odc_patches

from .engine import ODCEngineWithLMHead, ODCEngineWithValueHead

DEVICES = ["cuda", "cpu"]


def _register(model_type: str, engine_cls) -> None:
    # Registering twice raises in verl; the module can be imported again after a reload.
    if EngineRegistry._engines.get(model_type, {}).get("odc") is None:
        EngineRegistry.register(model_type, "odc", device=DEVICES)(engine_cls)


_register("language_model", ODCEngineWithLMHead)
_register("value_model", ODCEngineWithValueHead)
APPLIED_PATCHES = odc_patches.apply_all()
