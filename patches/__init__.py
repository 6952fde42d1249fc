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

Each patch module names the verl version it was written against (`VERL_VERSION`) and checks that what
it builds on still looks as it expects, raising `PatchError` otherwise, so that a verl upgrade fails
loudly at start-up instead of training wrongly. Another verl version fails odc runs only, at start, in
one line naming both versions (`require_odc_verl`); the CPU patches then apply where their own checks
pass, with a warning, since CPU mode serves runs of every strategy.
"""

from __future__ import annotations

import importlib
import logging

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
    "cpu_batch_order",
    "cpu_replay_poll",
    "cpu_sharded_save",
    "cpu_sft_step_time",
)


class PatchError(RuntimeError):
    """verl is not what a patch was written for."""


logger = logging.getLogger(__name__)
_warned_versions: set[str] = set()


def require_odc_verl() -> None:
    """An odc run's start: PatchError, in one line naming both versions, unless verl is the patched one."""
    import verl

    if verl.__version__ != PATCHED_VERL_VERSION:
        raise PatchError(
            f"strategy=odc needs verl {PATCHED_VERL_VERSION}, the version odc-verl's patches of verl were written "
            f"for, but verl {verl.__version__} is installed; install verl=={PATCHED_VERL_VERSION} for odc runs "
            f"(runs of other strategies do not use the patches)"
        )


def require_verl_version(patch: str, version: str = PATCHED_VERL_VERSION) -> None:
    """A patch module's version check: PatchError for a patch of odc runs; for a CPU patch one warning per
    process, and the patch applies if its own checks pass (CPU mode serves fsdp2 runs too, which another
    verl version must not fail)."""
    import verl

    if verl.__version__ == version:
        return
    message = f"odc patch '{patch}' targets verl {version}, but verl {verl.__version__} is installed"
    if patch not in CPU_PATCHES:
        raise PatchError(message)
    if verl.__version__ not in _warned_versions:
        _warned_versions.add(verl.__version__)
        logger.warning("%s; the CPU patches apply where their checks of verl pass (VERL_PLATFORM=cpu)", message)


def require_attr(owner, name: str, patch: str):
    """The attribute a patch replaces or builds on; a PatchError if verl no longer has it."""
    if not hasattr(owner, name):
        raise PatchError(f"odc patch '{patch}': {getattr(owner, '__name__', owner)}.{name} is gone in this verl")
    return getattr(owner, name)


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
    applied = []
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        module.apply()
        applied.append(name)
    return applied


def apply_after_import(after_import, names: tuple[str, ...] = CPU_PATCHES) -> None:
    """Apply each CPU patch of `names` once its `TARGET` module is imported, through `after_import(module,
    callback)` (see odc_plugin/verl/imports.py)."""
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        after_import(module.TARGET, module.apply)
