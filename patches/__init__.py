"""Every change this project makes to verl's internals.

Each patch module names the verl version it was written against (`VERL_VERSION`), the verl module it
changes (`TARGET`) and exposes `apply()`; `apply()` must check that what it replaces still looks the
way the patch expects and raise `PatchError` otherwise, so that a verl upgrade fails loudly at start-up
instead of training wrongly. The plugin applies each patch when its target module is first imported
(`apply_after_import`), never during `import verl` itself.
"""

from __future__ import annotations

import importlib

PATCHED_VERL_VERSION = "0.9.1"

# Patch modules, applied in this order.
PATCHES: tuple[str, ...] = ("lb_mini_worker", "lb_mini_dispatch", "rank_metrics_agree")
# What verl needs to run without an accelerator: applied only with VERL_PLATFORM=cpu.
CPU_PATCHES: tuple[str, ...] = (
    "cpu_process_group",
    "cpu_offload_unpinned",
    "cpu_valuehead_attn",
    "hf_rollout_registry",
    "cpu_layer_time",
    "cpu_ulysses_sdpa",
    "cpu_batch_order",
)


class PatchError(RuntimeError):
    """verl is not what a patch was written for."""


def require_verl_version(patch: str, version: str = PATCHED_VERL_VERSION) -> None:
    import verl

    if verl.__version__ != version:
        raise PatchError(f"odc patch '{patch}' targets verl {version}, but verl {verl.__version__} is installed")


def require_attr(owner, name: str, patch: str):
    """The attribute a patch replaces; a PatchError if verl no longer has it."""
    if not hasattr(owner, name):
        raise PatchError(f"odc patch '{patch}': {getattr(owner, '__name__', owner)}.{name} is gone in this verl")
    return getattr(owner, name)


def apply_all(names: tuple[str, ...] = PATCHES) -> list[str]:
    """Apply the patches `names` now (each once); returns the names applied."""
    applied = []
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        require_verl_version(name, module.VERL_VERSION)
        module.apply()
        applied.append(name)
    return applied


def apply_after_import(after_import, names: tuple[str, ...] = PATCHES) -> None:
    """Apply each patch of `names` once its `TARGET` module is imported, through `after_import(module,
    callback)` (see odc_plugin/verl/imports.py)."""
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        after_import(module.TARGET, module.apply)
