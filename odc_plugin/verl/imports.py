"""Run a function right after a module has been imported, or now if it already has been.

verl imports this plugin's entry point in the middle of `import verl`, before other plugins have had
their turn. Importing verl's engine or worker modules then would resolve and cache verl's device
platform (`verl/workers/engine/fsdp/transformer_impl.py` asks for the device name at import), so a
platform registered by a later plugin would be ignored. Everything this plugin does to those modules
(registering its engines, applying patches) therefore waits until something else imports them.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()
_pending: dict[str, list[Callable[[], None]]] = {}


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call `callback()` once `module` is fully imported (at once if it already is)."""
    with _lock:
        if module not in sys.modules:
            _pending.setdefault(module, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback()


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, with the callbacks run after the module body."""

    def __init__(self, loader, callbacks):
        self._loader, self._callbacks = loader, callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback()

    def __getattr__(self, name):  # resources, source, file names: the real loader's
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        with _lock:
            if fullname not in _pending:
                return None
            callbacks = _pending.pop(fullname)
        spec = _find_with_others(self, fullname, path, target)
        if spec is None or spec.loader is None:
            with _lock:
                _pending.setdefault(fullname, [])[:0] = callbacks
            return None
        spec.loader = _HookedLoader(spec.loader, callbacks)
        return spec


def _find_with_others(finder, fullname, path, target):
    for other in sys.meta_path:
        if other is not finder and hasattr(other, "find_spec"):
            spec = other.find_spec(fullname, path, target)
            if spec is not None:
                return spec
    return None


_FINDER = _Finder()
