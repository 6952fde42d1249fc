"""Imported by every process of a test's verl run, during `import verl` and before verl loads its plugins
(`VERL_USE_EXTERNAL_MODULES=tests.verl.stock_probe`), to observe or set up what the run's plugins find.

- `ODC_PROBE_DIR=DIR`: right after verl defines its trainer and worker classes, record every member of
  them, the content of their dispatch dicts and verl's trainer registry; then, every REPORT_S seconds until
  the process ends, write DIR/<pid>.json: which of those differ from what verl defined, and the classes of
  the trainers and workers the process has held (found through the garbage collector).
- `ODC_PROBE_VERL_VERSION=X`: verl reports version X (`verl.__version__`).
- `ODC_PROBE_CPU_ONLY=1`: verl runs on CPU without this project's plugin loaded (with
  VERL_USE_EXTERNAL_PLUGINS=none): only the VERL_PLATFORM=cpu machinery, `odc_plugin.verl.cpu`.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

import verl

from odc_plugin.verl.imports import after_import

PROBE_DIR = os.environ.get("ODC_PROBE_DIR")
# module -> the classes it defines whose members are recorded as soon as it is imported
CLASSES = {
    "verl.workers.engine_workers": ("TrainingWorker", "ActorRolloutRefWorker"),
    "verl.trainer.ppo.ray_trainer": ("RayPPOTrainer",),
    "verl.trainer.ppo.v1.trainer_base": ("PPOTrainer",),
    "verl.trainer.ppo.v1.trainer_sync": ("PPOTrainerSync",),
    "verl.trainer.ppo.v1.trainer_colocate_async": ("PPOTrainerColocateAsync",),
    "verl.trainer.ppo.v1.trainer_separate_async": ("PPOTrainerSeparateAsync",),
    "verl.trainer.ppo.v1": (),  # verl's trainer registry, once every trainer module has registered
}
# instances held by the process whose classes are reported, by the class they are instances of
HELD = {
    "verl.workers.engine_workers": ("TrainingWorker", "ActorRolloutRefWorker"),
    "verl.trainer.ppo.v1.trainer_base": ("PPOTrainer",),
}
# finding the held instances walks every object of the process (0.2 s with verl imported, in each of a run's
# ~10 processes): every second, that took most of the 2 cores and slowed the probed runs by 70%; the trainer
# and its workers live for most of the run, tens of seconds, so a look every few seconds sees them
REPORT_S = 5.0

_recorded: dict[str, object] = {}
# the classes of the held instances seen so far: the last report may come after the run released them
_held: set[type] = set()


def _members(module: str) -> dict[str, object]:
    from verl.single_controller.base.decorator import MAGIC_ATTR

    found = {}
    for name in CLASSES[module]:
        cls = getattr(sys.modules[module], name)
        for member, value in vars(cls).items():
            found[f"{name}.{member}"] = value
            mode = (getattr(value, MAGIC_ATTR, None) or {}).get("dispatch_mode")
            if isinstance(mode, dict):
                found[f"{name}.{member} dispatch"] = tuple(sorted(mode.items()))
    if module == "verl.trainer.ppo.v1":
        found["TRAINER_REGISTRY"] = tuple(
            sorted(sys.modules["verl.trainer.ppo.v1.trainer_base"].TRAINER_REGISTRY.items())
        )
    return found


def _record(module: str) -> None:
    _recorded.update(_members(module))


def _report() -> dict:
    current = {}
    for module in CLASSES:
        if module in sys.modules:
            current.update(_members(module))
    changed = sorted(k for k, v in _recorded.items() if k in current and current[k] != v and current[k] is not v)
    added = sorted(k for k in current if k not in _recorded)
    held_types = tuple(getattr(sys.modules[m], n) for m, names in HELD.items() if m in sys.modules for n in names)
    _held.update(type(o) for o in gc.get_objects() if held_types and isinstance(o, held_types))
    return {
        "pid": os.getpid(),
        "argv": sys.argv[:3],
        "recorded": sorted(_recorded),
        "changed": changed,
        "added": added,
        "held": sorted(f"{t.__module__}.{t.__qualname__}" for t in _held),
    }


def _watch() -> None:
    path = os.path.join(PROBE_DIR, f"{os.getpid()}.json")
    while True:
        if _recorded:
            with open(path + ".tmp", "w") as fp:
                json.dump(_report(), fp)
            os.replace(path + ".tmp", path)
        time.sleep(REPORT_S)


if os.environ.get("ODC_PROBE_VERL_VERSION"):
    verl.__version__ = os.environ["ODC_PROBE_VERL_VERSION"]
if os.environ.get("ODC_PROBE_CPU_ONLY"):
    from odc_plugin.verl import cpu

    cpu.enable(after_import)
if PROBE_DIR:
    # registered before any plugin's callbacks, so these run first: what verl itself defined
    for _module in CLASSES:
        after_import(_module, lambda module=_module: _record(module))
    threading.Thread(target=_watch, daemon=True, name="stock_probe").start()
