"""run_ranks leaves nothing running and nothing on disk, even when its own process is stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


def write_pid_and_sleep(rank, world, out_dir):
    with open(os.path.join(out_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def fail_on_one(rank, world, how):
    """Rank 1 fails (raises or is killed by a signal) while rank 0 waits on and would outlive the grace period."""
    if rank == 1:
        if how == "raise":
            raise ValueError("bad input on rank 1")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


@pytest.mark.parametrize(
    "how,error", [("raise", "ValueError: bad input on rank 1"), ("signal", "died of SIGKILL and left no result")]
)
def test_the_rank_that_failed_first_is_named_not_the_one_the_launcher_killed(how, error):
    from odc_plugin.launch import RankFailed, run_ranks

    with pytest.raises(RankFailed) as failure:
        run_ranks(fail_on_one, 2, how, failure_grace_s=1.0)
    first_line = str(failure.value).splitlines()[0]
    assert first_line == (
        f"rank 1 failed: {error} (also rank 0: was killed by the launcher 1 s after rank 1 failed and left no result)"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_ranks_die_with_a_parent_killed_by_sigterm_and_its_temp_dirs_go(tmp_path):
    # The parent's TMPDIR: its results and fork-server directories go there. Short, since the fork server's
    # socket lives in it and a Unix socket's path has at most 107 bytes (pytest's tmp_path can be longer).
    temp_dir = Path(tempfile.mkdtemp(prefix="odc-", dir="/tmp"))
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "from odc_plugin.launch import run_ranks\n"
                "from tests.launch.test_launch import write_pid_and_sleep\n"
                f"run_ranks(write_pid_and_sleep, 2, {str(tmp_path)!r})\n"
            ),
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env={**os.environ, "TMPDIR": str(temp_dir)},
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "ranks did not start"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        parent.send_signal(signal.SIGTERM)
        parent.wait(30)
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, pids)), "a rank outlived its parent"
        assert parent.returncode == 128 + signal.SIGTERM, parent.returncode
        # torch's compile cache (torchinductor_<user>) is meant to outlive the process.
        left = sorted(p.name for p in temp_dir.iterdir() if not p.name.startswith("torchinductor_"))
        assert not left, f"left behind: {left}"
    finally:
        parent.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
