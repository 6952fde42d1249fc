"""Sleeping on a 32-bit word of shared memory until another process changes it (Linux futex).

A waiting rank must not take a core: with 32 ranks on 2 cores a rank that polls steals the time its
peers need to get to where it waits for them. FUTEX_WAIT puts the caller to sleep in the kernel until a
FUTEX_WAKE on the same word, from any process that maps the same file; the word is keyed by file and
offset, so the mapping's address may differ between processes. Elsewhere (no futex) a wait is a 1 ms
sleep, so callers re-check in a loop either way.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform.startswith("linux") else None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG: the word is shared between processes
_WAKE_ALL = 2**31 - 1
_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at `address` holds `expected`, for at most `timeout_s`. Returns on a wake,
    at once if the word already differs, on a signal or at the timeout: the caller checks again."""
    if _libc is None:
        time.sleep(min(timeout_s, 1e-3))
        return
    timeout_s = max(timeout_s, 0.0)
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(expected),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )


def wake(address: int) -> None:
    """Wake every process sleeping on the int32 at `address`."""
    if _libc is not None:
        _libc.syscall(
            ctypes.c_long(_SYS_FUTEX),
            ctypes.c_void_p(address),
            ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(_WAKE_ALL),
            None,
            None,
            ctypes.c_int(0),
        )
