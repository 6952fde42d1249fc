"""Run a function on W processes joined by a process group (gloo by default): tests, benchmarks, the demo;
and end a command's whole process group (stop_group).

Each rank runs with one thread so that W ranks on W cores do not fight over them. Ranks are forked from
a server process that has imported torch and transformers once (multiprocessing's forkserver), so 32 ranks
start in seconds instead of each importing them again (about 4 s of CPU each). Results come back
through files (torch.save), not pipes, so a rank may return tensors and exit at once. If any rank fails,
the others are killed and the first failure is raised with its traceback; nothing is left running, and
nothing is left on disk either when the launcher itself is stopped with SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import wait as wait_for_exits
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm.shm import remove_files_of

# What every rank imports anyway; nothing here may import verl, which a rank's `setup` must precede.
_PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "transformers.models.qwen2.modeling_qwen2"]


# Failures the launcher sees this close together count as one moment (see run_ranks' failure order).
_SAME_MOMENT_S = 1.0


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries its traceback or exit code."""


def _by_name(fn):
    """Send a module-level function by name: its module is then imported in the child only after
    `setup` has run (a module that imports verl at the top must see the setup first)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<locals>" not in qualname:
        return (module, qualname)
    return fn


def _resolve(fn):
    if not isinstance(fn, tuple):
        return fn
    obj = importlib.import_module(fn[0])
    for part in fn[1].split("."):
        obj = getattr(obj, part)
    return obj


def _die_with_launcher(launcher: int) -> None:
    """A launcher killed by a signal runs no cleanup: a thread of this rank ends it once the launcher is
    gone (Linux: it blocks on a pidfd, which becomes readable when that process exits)."""
    if not hasattr(os, "pidfd_open"):
        return
    try:
        gone = os.pidfd_open(launcher)
    except ProcessLookupError:  # it died before this rank started
        os._exit(1)

    def watch() -> None:
        select.select([gone], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="odc-launcher-watch", daemon=True).start()


class _LauncherFd:
    """One of the launcher's file descriptors, handed to a forked rank as it is pickled for the fork server
    (the server passes it on, so the rank shares the launcher's open file and its offset)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def _write_where_the_launcher_writes(stdout: int, stderr: int) -> None:
    """A forked rank inherits the fork server's stdout and stderr, which are the launcher's as they were
    when the server started; use the launcher's as they are now (a redirect, a test's capture)."""
    for mine, fd in ((stdout, 1), (stderr, 2)):
        os.dup2(mine, fd)
        os.close(mine)


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pt")


def _rank_main(fn, rank, world_size, port, out_dir, args, pg_timeout_s, setup, backend, launcher, stdio):
    _die_with_launcher(launcher)
    _write_where_the_launcher_writes(*stdio)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # The launcher hosts the job's store, as torchrun's agent does: a rank that fails and exits first
        # (rank 0 included) leaves it to the ranks still reading the failure from it.
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    torch.set_num_threads(1)
    path = _result_path(out_dir, rank)
    try:
        if setup is not None:
            setup()
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        result = _resolve(fn)(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it with the traceback
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, path)
        os._exit(1)
    # Leave without tearing the group down: a rank that waits in destroy_process_group for a dead peer
    # would hang, and the parent only needs the result file.
    os._exit(0)


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM (a scheduler, `kill`) raises SystemExit while ranks run, so the launcher cleans up as on
    Ctrl-C: its ranks killed, its results directory and the fork server's socket directory removed. The
    default action would end the process on the spot and leave both directories in the temp dir. Left
    alone where a SIGTERM handler is already set, or off the main thread (where Python cannot set one)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout_s: float = 600.0,
    pg_timeout_s: float = 120.0,
    failure_grace_s: float = 30.0,
    setup: Callable[[], None] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return the per-rank results.

    `fn` must be importable (a module-level function); `setup`, if given, runs in each rank before the
    process group starts and before `fn`'s module is imported. Raises RankFailed naming the rank that
    failed first; if one fails, the others get `failure_grace_s` to finish, then are killed.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when this process starts its fork server
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    with _sigterm_exits(), tempfile.TemporaryDirectory(prefix="odc-ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_rank_main,
                daemon=True,
                args=(
                    _by_name(fn),
                    r,
                    world_size,
                    port,
                    out_dir,
                    args,
                    pg_timeout_s,
                    setup,
                    backend,
                    os.getpid(),
                    (_LauncherFd(1), _LauncherFd(2)),
                ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at: dict[int, float] = {}  # when each failed rank was first seen to have exited non-zero
        killed: dict[int, str] = {}  # the ranks the launcher ended, and why
        try:
            while (running := [p.sentinel for p in procs if p.exitcode is None]) and time.monotonic() < deadline:
                wait_for_exits(running, timeout=deadline - time.monotonic())  # returns as soon as one exits
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in failed_at:
                        failed_at[r] = now
                        # One rank failed: the rest get a grace period to fail on their own (a barrier
                        # timeout, say) so their errors are reported too.
                        deadline = min(deadline, now + failure_grace_s)
        finally:
            # Ranks seen to fail at about the same moment: one that died without writing its error (a signal,
            # an exit) is the likelier cause of the others' failures, which they had time to write. Peers see
            # a dead rank's process before its exit status reaches the launcher (through the fork server), so
            # a survivor's exit can be seen first.
            earliest = min(failed_at.values(), default=0.0)

            def failure_order(r: int) -> tuple:
                at = failed_at.get(r, float("inf"))
                moment = earliest if at - earliest <= _SAME_MOMENT_S else at
                return moment, r in killed, os.path.exists(_result_path(out_dir, r)), at, r

            first = min(failed_at, key=failure_order, default=None)
            for r, p in enumerate(procs):
                if p.is_alive():
                    p.kill()
                    killed[r] = (
                        f"was killed by the launcher {failure_grace_s:g} s after rank {first} failed"
                        if first is not None
                        else f"was killed by the launcher at its time limit ({timeout_s:g} s)"
                    )
                p.join()
            # A rank killed while it set up a shared-memory region ran no clean-up: its files go now.
            remove_files_of(p.pid for p in procs)
        results = []
        for r, p in enumerate(procs):
            path = _result_path(out_dir, r)
            if not os.path.exists(path):
                code = p.exitcode
                died = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                why = killed.get(r, died)
                results.append({"ok": False, "error": f"{why} and left no result", "traceback": ""})
            else:
                results.append(torch.load(path, weights_only=False))
        # The first rank to fail first, the ones the launcher killed last.
        failed = sorted((r for r, res in enumerate(results) if not res["ok"]), key=failure_order)
        if failed:
            r, res = failed[0], results[failed[0]]
            others = ", ".join(f"rank {q}: {results[q]['error']}" for q in failed[1:])
            raise RankFailed(
                f"rank {r} failed: {res['error']}" + (f" (also {others})" if others else "") + f"\n{res['traceback']}"
            )
        return [res["result"] for res in results]


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End a command started with `start_new_session=True` and every process it started: SIGTERM to its
    process group, SIGKILL after `grace_s`. run_ranks' ranks are its own children and end with kill(); a
    command (a pytest run, a benchmark) starts processes of its own that only its group reaches."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
            return
