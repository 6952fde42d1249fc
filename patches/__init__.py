"""Every change this project makes to verl's internals, applied when the plugin loads.

Each patch module names the verl version it was written against (`VERL_VERSION`) and exposes
`apply()`; `apply()` must check that what it replaces still looks the way the patch expects and raise
`PatchError` otherwise, so that a verl upgrade fails loudly at start-up instead of training wrongly.
"""

from __future__ import annotations

import importlib

PATCHED_VERL_VERSION = "0.9.1"

# Patch modules, applied in this order.
PATCHES: tuple[str, ...] = ("lb_mini_worker", "lb_mini_dispatch")


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


def apply_all() -> list[str]:
    """Apply every patch once; returns the names applied."""
    applied = []
    for name in PATCHES:
        module = importlib.import_module(f"{__name__}.{name}")
        require_verl_version(name, module.VERL_VERSION)
        module.apply()
        applied.append(name)
    return applied
