"""verl 0.9.1 on a machine without an accelerator, opt-in with `VERL_PLATFORM=cpu`.

Everything here acts only when the environment says VERL_PLATFORM=cpu (and then says so in one log
line): a `cpu` device platform with gloo (`platform.py`), verl's own FSDP engines registered for
device cpu, the patches verl needs without an accelerator (`odc_patches.CPU_PATCHES`), the `hf`
rollout (`rollout.py`) and the `gloo` checkpoint engine for a rollout in processes of its own
(`checkpoint_engine.py`). A GPU run never sets it and is unchanged. Tests, the examples and
`odc-grpo-cpu` all run verl on CPU through this one module.
"""

from __future__ import annotations

import logging
import os

PLATFORM_ENV = "VERL_PLATFORM"
# "R:F[,R:F]": training rank R's layers take F times as long (patches/cpu_layer_time.py, odc-grpo-cpu --slow-ranks)
SLOW_RANKS_ENV = "ODC_SLOW_RANKS"
# the JSON file of a run's Emulation (emulation.py, odc-grpo-cpu --emulate)
EMULATION_ENV = "ODC_EMULATION"
ROLLOUT_NAME = "hf"
logger = logging.getLogger(__name__)


def requested() -> bool:
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == "cpu"


def enable(after_import) -> None:
    """Register the platform now; everything that touches verl's engine and worker modules waits for
    their import (`after_import`, see odc_plugin/verl/imports.py)."""
    import odc_patches

    from . import platform

    platform.register()
    after_import("verl.workers.engine", _register_stock_engines)
    after_import("verl.workers.rollout.replica", _register_rollout)
    after_import("verl.checkpoint_engine.base", _register_checkpoint_engine)
    after_import("verl.experimental.agent_loop.agent_loop", _register_agent_loop)
    odc_patches.apply_after_import(after_import, odc_patches.CPU_PATCHES)
    logger.warning(
        "odc_plugin: %s=cpu: verl runs on CPU (gloo process groups, FSDP engines on device cpu, "
        "rollout 'hf'); no accelerator is used",
        PLATFORM_ENV,
    )


def _register_stock_engines() -> None:
    """verl registers its FSDP engines for cuda and npu only."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine_cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(engine_cls)


def _register_rollout() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def load():
        from .rollout import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register(ROLLOUT_NAME, load)


def _register_checkpoint_engine() -> None:
    from .checkpoint_engine import register

    register()


def _register_agent_loop() -> None:
    from . import agent_loop  # noqa: F401  (registers AGENT_NAME with verl's agent loop registry)
