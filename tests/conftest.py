"""Test-session order (the trainer tests first) and clean-up of what verl leaves in the temp dir."""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile

import pytest

# Two workers take groups of tests (pyproject's addopts): the longest, verl's real trainer runs (stock verl
# with and without the plugin ~9 min, the emulated ranks ~5 min, each group of test_main_ppo and each of
# verl's settings 2-7 min), must start first: started last, any one alone would set the suite's wall time.
# (xdist orders groups by their test count unless --no-loadscope-reorder, which addopts gives: that put
# these, of few tests each, last.)
LONGEST_FIRST = (
    "tests/verl/test_stock_verl.py",
    "tests/verl/test_main_ppo.py",
    "tests/verl/test_trainer_emulated.py",
    "tests/verl/test_verl_settings.py",
    "tests/verl/test_trainer_modes.py",
    "tests/verl/test_sft.py",
    "tests/test_docs.py",
    "tests/verl/test_main_ppo_lifecycle.py",
    "tests/test_torch_pins.py",
)

# verl's checkpoint saving (verl.utils.fs.local_mkdir_safe) leaves an empty lock file in the temp dir
# for every directory it creates and never removes it; the suite's checkpoints would leave ~100 a run.
_VERL_LOCKS_BEFORE = pytest.StashKey[set]()


def _verl_lock_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ckpt_*.lock")))


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """The longest files first; a test without an xdist group in its file's group, so that a worker takes a
    file whole, its module fixtures once (pyproject's --dist loadgroup), unless the file splits itself into
    groups (verl's trainer runs: a group per run or set of runs a fixture shares)."""
    items.sort(key=lambda item: LONGEST_FIRST.index(f) if (f := item.nodeid.split("::")[0]) in LONGEST_FIRST else 99)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_sessionstart(session):
    session.stash[_VERL_LOCKS_BEFORE] = _verl_lock_files()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller removes them once every worker is done
    for path in _verl_lock_files() - session.stash[_VERL_LOCKS_BEFORE]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
