"""What ODC holds while the rollout generates, seen from outside the engines (a trainer run's processes).

Loaded into every process of a run by `VERL_USE_EXTERNAL_MODULES=tests.verl.rollout_watch` (verl imports
it during `import verl`); acts only where `ODC_ROLLOUT_WATCH` names a file. The `hf` rollout's server
becomes `WatchedHFRolloutServer`: every generate request first reads which of ODC's shared-memory files
each other worker of the run (the processes the same raylet started) maps, from their /proc/PID/maps, and
appends them to that file as one JSON line: {"processes": {pid: [[region, owner rank, bytes], ...]}}.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

WATCH_ENV = "ODC_ROLLOUT_WATCH"
_ROLLOUT = "odc_plugin.verl.cpu.rollout"


def _record(path: str) -> None:
    import psutil

    from tests.fsdp.memory_workers import shm_mappings

    me = psutil.Process()
    seen = {}
    for proc in me.parent().children(recursive=True):  # the raylet's workers: every process of the run's node
        if proc.pid == me.pid:
            continue
        try:
            mapped = shm_mappings(proc.pid)
        except (OSError, psutil.Error):
            continue  # gone in the meantime
        if mapped:
            seen[proc.pid] = [[m.region, m.owner, m.nbytes] for m in mapped]
    with open(path, "a", encoding="utf-8") as fp:
        fp.write(json.dumps({"processes": seen}) + "\n")


def _watched(server: type) -> type:
    class WatchedHFRolloutServer(server):
        async def generate(self, *args, **kwargs):
            _record(os.environ[WATCH_ENV])
            return await super().generate(*args, **kwargs)

    # importable by name: Ray sends the server's class to its actor process by reference
    WatchedHFRolloutServer.__qualname__ = WatchedHFRolloutServer.__name__
    return WatchedHFRolloutServer


def _use_watched_server() -> None:
    """Once the rollout module is imported: its server class becomes the watched one (made once)."""
    rollout = sys.modules[_ROLLOUT]
    if not hasattr(rollout, "HFRolloutServer"):
        return  # the rollout's own import, which imports verl, and so this module, first
    if "WatchedHFRolloutServer" not in globals():
        globals()["WatchedHFRolloutServer"] = _watched(rollout.HFRolloutServer)
    rollout.HFRolloutServer = globals()["WatchedHFRolloutServer"]


def __getattr__(name: str):
    # the class is made once the rollout is imported, not with this module: `import verl` imports this
    # module, and the rollout imports verl (a Ray actor process unpickling the class gets here first)
    if name == "WatchedHFRolloutServer":
        importlib.import_module(_ROLLOUT)
        _use_watched_server()
        return globals()[name]
    raise AttributeError(name)


if os.environ.get(WATCH_ENV):
    from odc_plugin.verl.imports import after_import

    after_import(_ROLLOUT, _use_watched_server)
