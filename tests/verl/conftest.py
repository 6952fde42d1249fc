"""Fixtures shared by the tests of verl's patches."""

from __future__ import annotations

import pytest


@pytest.fixture
def other_verl(monkeypatch):
    """verl reporting version 0.9.2: the patches read verl's version once per process, so its reading is
    dropped before and after (the test's own reading, then the real one again)."""
    import verl

    import odc_patches

    def forget():
        odc_patches.installed_verl.cache_clear()
        odc_patches._warn_unless_patched_verl.cache_clear()

    forget()
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    yield "0.9.2"
    monkeypatch.undo()
    forget()
