"""The suite's groups take effect: under pyproject's `--dist loadgroup` a worker takes a file's tests whole
(tests/conftest.py), so that its module fixtures (verl's trainer runs, minutes each) run once, not once per
worker. xdist marks a grouped test by an `@group` suffix of its node id; where that is lost (pytest 9.2
with xdist 3.8), every test is scheduled alone and the suite silently runs its trainer runs twice over.
"""

from __future__ import annotations

import pytest


def test_this_file_runs_as_one_group_under_loadgroup(request):
    if not getattr(request.config.option, "loadgroup", False):  # xdist's own flag for --dist loadgroup
        pytest.skip("not run under --dist loadgroup")
    assert request.node.nodeid.endswith("@tests/test_suite_groups.py"), request.node.nodeid
