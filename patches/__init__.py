"""Every change this project makes to verl's internals.

Two kinds, applied differently:

* **For odc runs** (`PATCHES`): what `strategy=odc` needs of verl's trainer and workers. None of them
  changes a verl class or function: each adds members to the subclasses of verl's classes that odc runs
  use instead (`odc_subclass`: the trainer of the run's mode, `ActorRolloutRefWorker` and separate_async's
  `DetachActorWorker`, `TrainingWorker`),
  through `extend(kind, base, members)`. odc_plugin/verl/trainer.py puts those subclasses in place through
  verl's own extension points, and only when the run's configuration names odc; a run of other
  strategies executes verl's own classes and functions. Their one touch of verl itself is the choice
  (`trainer_choice.py`, applied in every process, acting on odc configurations only).
* **For CPU** (`CPU_PATCHES`): what verl 0.9.1 needs to run without an accelerator; each `apply()`
  replaces a verl function in place, only with VERL_PLATFORM=cpu (odc_plugin/verl/cpu), and only when
  its `TARGET` module is imported (`apply_after_import`), never during `import verl` itself.

All of them are written against one verl, `PATCHED_VERL_VERSION`, which is checked once per process
(`installed_verl`). Another verl version fails odc runs only, at start, in one line naming both versions
(`require_odc_verl`); the CPU patches then apply where their own checks pass, after one warning, since CPU
mode serves runs of every strategy. Each patch checks that what it builds on still looks as it expects,
raising `PatchError` otherwise, so that a verl upgrade fails loudly at start-up instead of training wrongly.
A patch that replaces an attribute of verl's does it through `replace_attr`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

PATCHED_VERL_VERSION = "0.9.1"

# For odc runs: each extends the odc subclasses, in this order (a later one may wrap an earlier one's member).
PATCHES: tuple[str, ...] = ("lb_mini_worker", "lb_mini_dispatch", "rank_metrics_agree", "detach_actor")
# The classes odc runs subclass, by kind: the trainer class of the run's mode, and the two worker classes.
KINDS: tuple[str, ...] = ("trainer", "actor_worker", "training_worker")
# What verl needs to run without an accelerator: applied only with VERL_PLATFORM=cpu.
CPU_PATCHES: tuple[str, ...] = (
    "cpu_process_group",
    "cpu_offload_unpinned",
    "cpu_valuehead_attn",
    "hf_rollout_registry",
    "cpu_layer_time",
    "cpu_ulysses_sdpa",
    "cpu_vl_attention",
    "cpu_vl_text_batches",
    "cpu_batch_order",
    "cpu_replay_poll",
    "cpu_sharded_save",
    "cpu_vision_info",
)


class PatchError(RuntimeError):
    """verl is not what a patch was written for."""


logger = logging.getLogger(__name__)


@functools.cache
def installed_verl() -> str:
    """verl's version, read once per process: every patch of the process is checked against this one."""
    import verl

    return verl.__version__


def require_odc_verl() -> None:
    """An odc run's start: PatchError, in one line naming both versions, unless verl is the patched one."""
    if installed_verl() != PATCHED_VERL_VERSION:
        raise PatchError(
            f"strategy=odc needs verl {PATCHED_VERL_VERSION}, the version odc-verl's patches of verl were written "
            f"for, but verl {installed_verl()} is installed; install verl=={PATCHED_VERL_VERSION} for odc runs "
            f"(runs of other strategies do not use the patches)"
        )


@functools.cache
def _warn_unless_patched_verl() -> None:
    """Before the CPU patches: one warning per process on another verl, which must not fail fsdp2 runs."""
    if installed_verl() != PATCHED_VERL_VERSION:
        logger.warning(
            "odc's CPU patches target verl %s, but verl %s is installed; they apply where their checks of verl "
            "pass (VERL_PLATFORM=cpu)",
            PATCHED_VERL_VERSION,
            installed_verl(),
        )


def require_attr(owner, name: str, patch: str):
    """The attribute a patch replaces or builds on; a PatchError if verl no longer has it."""
    if not hasattr(owner, name):
        raise PatchError(f"odc patch '{patch}': {getattr(owner, '__name__', owner)}.{name} is gone in this verl")
    return getattr(owner, name)


def replace_attr(owner, name: str, patch: str, make: Callable[[object], object]) -> None:
    """Replace verl's `owner.name` by `make(current)`, once: a second call finds it replaced and does nothing.
    `make` checks what it builds on (PatchError) and returns the replacement, which gets the replaced one's
    name, docstring and attributes (verl's dispatch registration among them)."""
    current = require_attr(owner, name, patch)
    if getattr(current, "_odc_patched", False):
        return
    replacement = make(current)
    functools.update_wrapper(replacement, current, updated=() if isinstance(current, type) else ("__dict__",))
    replacement._odc_patched = True
    setattr(owner, name, replacement)


def parameters(fn) -> list[str]:
    """The parameter names of verl's function `fn` as its code declares them. Not inspect.signature, which
    reads a `__signature__` first: Ray's tracing sets one with an added `_ray_trace_ctx` on the functions of
    every class it makes an actor of (verl's TrainingWorker for a critic, before odc checks it)."""
    import inspect

    code = fn.__code__
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return list(code.co_varnames[:count])


def odc_subclass(kind: str, base: type, name: str, module: str, mixins: tuple[type, ...] = (), **members) -> type:
    """The subclass of verl's `base` that odc runs use: `members`, and what each patch of PATCHES adds for
    `kind` (one of KINDS), on `mixins` + `base`. Checks verl's version and every patch's assumptions first;
    changes nothing of verl's. `name` and `module` make it importable by name (Ray sends worker classes by
    reference)."""
    if kind not in KINDS:
        raise ValueError(f"odc_subclass: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    require_odc_verl()
    namespace = {"__module__": module, "__qualname__": name, **members}
    for patch in PATCHES:
        importlib.import_module(f"{__name__}.{patch}").extend(kind, base, namespace)
    return type(name, (*mixins, base), namespace)


def apply_all(names: tuple[str, ...] = CPU_PATCHES) -> list[str]:
    """Apply the CPU patches `names` now (each once); returns the names applied."""
    _warn_unless_patched_verl()
    for name in names:
        importlib.import_module(f"{__name__}.{name}").apply()
    return list(names)


def apply_after_import(after_import, names: tuple[str, ...] = CPU_PATCHES) -> None:
    """Apply each CPU patch of `names` once its `TARGET` module is imported, through `after_import(module,
    callback)` (see odc_plugin/verl/imports.py)."""
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        after_import(module.TARGET, functools.partial(_apply_checked, module.apply))


def _apply_checked(apply: Callable[[], None]) -> None:
    _warn_unless_patched_verl()
    apply()
