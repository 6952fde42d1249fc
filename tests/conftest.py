"""Test-session order: the trainer tests first."""

from __future__ import annotations

# With two workers taking a file each (pyproject's addopts), the longest file, verl's real trainer
# runs (~11 min), must start first: started last, it alone would set the suite's wall time.
LONGEST_FIRST = ("tests/verl/test_main_ppo.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)
