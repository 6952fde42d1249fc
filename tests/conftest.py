"""Test-session order (the trainer tests first) and clean-up of what verl leaves in the temp dir."""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile

import pytest

# With two workers taking a file each (pyproject's addopts), the longest files, verl's real trainer
# runs (~11 min at 2 ranks, ~9 min for verl's settings, ~4 min at 8 emulated ones, ~4.5 min for stock
# verl with and without the plugin), must start first: started last, any one alone would set the suite's
# wall time. (xdist orders files by their test count unless --no-loadscope-reorder, which addopts gives:
# that put these files, of few tests each, last.)
LONGEST_FIRST = (
    "tests/verl/test_main_ppo.py",
    "tests/verl/test_verl_settings.py",
    "tests/verl/test_trainer_emulated.py",
    "tests/verl/test_stock_verl.py",
)

# verl's checkpoint saving (verl.utils.fs.local_mkdir_safe) leaves an empty lock file in the temp dir
# for every directory it creates and never removes it; the suite's checkpoints would leave ~100 a run.
_VERL_LOCKS_BEFORE = pytest.StashKey[set]()


def _verl_lock_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ckpt_*.lock")))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)


def pytest_sessionstart(session):
    session.stash[_VERL_LOCKS_BEFORE] = _verl_lock_files()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller removes them once every worker is done
    for path in _verl_lock_files() - session.stash[_VERL_LOCKS_BEFORE]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
