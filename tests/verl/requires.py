"""What some verl tests need installed, as skip markers."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None
needs_transfer_queue = pytest.mark.skipif(
    not HAS_TQ,
    reason="needs the TransferQueue package, which verl's v1 trainer imports (pip install TransferQueue==0.1.10)",
)
