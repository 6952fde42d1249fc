"""One run of verl's trainer as a supervised process tree: its output to a log, its progress by step, a
time limit and the Ray processes it leaves killed, its peak memory, the exception that ended it."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from . import PLATFORM_ENV

STEP_LINE = re.compile(r"\bstep:(\d+) - ")


@dataclass
class RunResult:
    strategy: str
    returncode: int
    wall_s: float
    peak_pss_gib: float  # proportional set size of the trainer's process tree (driver, Ray, workers, rollout)
    steps: int  # training steps the run logged
    log_file: str
    metrics_file: str
    ray_dir: str  # the Ray session's directory (removed afterwards); no process may still name it


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def ray_processes(ray_dir: str) -> list:
    """Processes of the Ray cluster started with `_temp_dir=ray_dir` (gcs, raylet, workers, ...)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(ray_dir in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _kill(procs) -> None:
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as fp:  # the kernel's sum, cheaper than psutil's full smaps
        for line in fp:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class _Watch(threading.Thread):
    """Samples the run's memory, and kills the run at its deadline."""

    def __init__(self, proc: subprocess.Popen, ray_dir: str, timeout_s: float):
        super().__init__(daemon=True)
        self.proc, self.ray_dir, self.deadline = proc, ray_dir, time.monotonic() + timeout_s
        self.peak_pss, self.timed_out, self.seen = 0, False, {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        # Reading a process's PSS walks its page tables (~6 ms for a torch process, ~30 processes per run):
        # every 2 s keeps the sampling's own CPU time to a few percent of one core.
        while not self._stop_event.wait(2.0):
            total = 0
            for proc in _tree(self.proc.pid):
                self.seen[proc.pid] = proc
                with contextlib.suppress(OSError, psutil.Error):
                    total += _pss(proc.pid)  # shared pages (torch, verl) counted once
            self.peak_pss = max(self.peak_pss, total)
            if time.monotonic() > self.deadline and self.proc.poll() is None:
                self.timed_out = True
                _kill(_tree(self.proc.pid))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        _kill([p for p in self.seen.values() if p.is_running()])
        end_ray(self.ray_dir)


def end_ray(ray_dir: str) -> None:
    """Ray daemons outlive a killed driver; nothing of the run whose Ray session lived in `ray_dir` stays behind."""
    _kill(ray_processes(ray_dir))
    shutil.rmtree(ray_dir, ignore_errors=True)


# verl picks its rendezvous port by binding port 0 and releasing it (`get_master_addr_port`); rank 0
# listens on it seconds later, and any process on the machine may take it in between (an outgoing
# connection, another job's gloo). Stock verl fails such a run at start; nothing has trained then.
_PORT_TAKEN = "EADDRINUSE"
PORT_RETRIES = 2


def run_trainer(strategy: str, args: list[str], out_dir: str, steps: int, timeout_s: float, echo=print) -> RunResult:
    """One `python -m verl.trainer.main_ppo` run; its output goes to DIR/<strategy>.log, progress to `echo`.
    A run whose rendezvous port was taken before its first step is started again, up to PORT_RETRIES
    times; the failed attempt's log is kept as DIR/<strategy>.port-taken-<n>.log."""
    attempt = 0
    while True:
        result = _run_once(strategy, args, out_dir, steps, timeout_s, echo)
        if attempt == PORT_RETRIES or not port_taken_at_start(result):
            return result
        attempt += 1
        os.replace(result.log_file, os.path.join(out_dir, f"{strategy}.port-taken-{attempt}.log"))
        echo(f"  {strategy}: verl's rendezvous port was taken before rank 0 listened; starting the run again")


def port_taken_at_start(result: RunResult) -> bool:
    """Whether a run failed before its first step because its rendezvous port was taken."""
    if result.returncode == 0 or result.steps:
        return False
    with open(result.log_file, encoding="utf-8", errors="replace") as fp:
        return _PORT_TAKEN in fp.read()


def start_logged(cmd: list[str], env: dict, log) -> subprocess.Popen:
    """`cmd` in a session of its own (so that its whole process group can be ended), its command line first in
    `log`, its output and errors to be read from its stdout (`follow`)."""
    log.write(shlex.join(cmd) + "\n")
    log.flush()
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        errors="replace",
        start_new_session=True,
    )


def follow(proc: subprocess.Popen, log, on_step) -> None:
    """Copy a trainer's output into `log` as it comes, calling `on_step(step, line)` at each of its step lines."""
    for line in proc.stdout:
        log.write(line)
        match = STEP_LINE.search(line)
        if match:
            on_step(int(match.group(1)), line)


def run_files(out_dir: str, strategy: str) -> tuple[str, str]:
    """A run's log and metrics files in `out_dir`; an earlier run's metrics go (verl's file logger appends)."""
    log_file = os.path.join(out_dir, f"{strategy}.log")
    metrics_file = os.path.join(out_dir, f"{strategy}.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    return log_file, metrics_file


def ray_session(env: dict) -> str:
    """A new directory for one run's Ray session (under /tmp, not beside the run's output: Ray's AF_UNIX socket
    paths must stay short); `env`, the run's environment, loses CUDA_VISIBLE_DEVICES, whose empty value makes
    Ray hide the CPU platform's GPUs."""
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return tempfile.mkdtemp(prefix="odc-ray-")


def _run_once(strategy: str, args: list[str], out_dir: str, steps: int, timeout_s: float, echo) -> RunResult:
    log_file, metrics_file = run_files(out_dir, strategy)
    env = {**os.environ, PLATFORM_ENV: "cpu", "VERL_FILE_LOGGER_PATH": metrics_file, "PYTHONUNBUFFERED": "1"}
    ray_dir = ray_session(env)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args, f"+ray_kwargs.ray_init._temp_dir={ray_dir}"]
    start = time.monotonic()
    done = 0

    def progress(step: int, line: str) -> None:
        nonlocal done
        done = step
        seconds = re.search(r"timing_s/step:([0-9.]+)", line)
        took = f" ({float(seconds.group(1)):.1f} s)" if seconds else ""
        echo(f"  {strategy}: step {done}/{steps} done{took}")

    with open(log_file, "w", encoding="utf-8") as log:
        proc = start_logged(cmd, env, log)
        watch = _Watch(proc, ray_dir, timeout_s)
        watch.start()
        try:
            follow(proc, log, progress)
            proc.wait()
        except BaseException:
            _kill(_tree(proc.pid))
            raise
        finally:
            watch.stop()
    wall = time.monotonic() - start
    returncode = proc.returncode if not watch.timed_out else -signal.SIGKILL
    if watch.timed_out:
        with open(log_file, "a", encoding="utf-8") as log:
            log.write(f"\nodc-grpo-cpu: killed after {timeout_s:g} s\n")
    return RunResult(strategy, returncode, wall, watch.peak_pss / 2**30, done, log_file, metrics_file, ray_dir)


# A line that states an exception: its class name (dotted or not) first, then ":" or "(" or nothing
# ("ValueError: ...", "ray.exceptions.ActorDiedError: ...", "ValueError(...)"); not a warning that
# mentions one ("UserWarning: ... ModuleNotFoundError(...)").
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?:\(.*\))?(?:[:(].*)?$"
)
# torchrun's own exception after a rank failed: the rank's is the one to report
_LAUNCHER_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
# Ray prefixes a worker's output with its name and pid: "(TaskRunner pid=123) ", "(WorkerDict pid=4, ip=...) ".
_RAY_PREFIX = re.compile(r"^\([^()]*pid=\d+[^()]*\)\s*")
# hydra refusing a command line prints its message and then this hint, no exception; before the message, the
# output is a warning's source line or a log record
_HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"
_BEFORE_HYDRAS_MESSAGE = re.compile(r"^(warnings\.warn\(|[A-Z]+:|[IWEF]\d{4} )")


def last_error(log_file: str) -> str:
    """The exception that ended a failed run, as its own line states it: the last line of the run's
    output that starts with an exception's name (warnings printed after it are passed over), with the
    note ODC puts under a rank's own exception that failed a mini-batch on every rank (which rank); else
    the first lines of hydra's refusal of the command line; else the last line naming an error; else the last
    line."""
    with open(log_file, encoding="utf-8", errors="replace") as fp:
        lines = [_RAY_PREFIX.sub("", line.strip()) for line in fp if line.strip()]
    for i in reversed(range(len(lines))):
        if _EXCEPTION_LINE.match(lines[i]) and not lines[i].startswith(_LAUNCHER_ERROR):
            note = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("ODC: ") else ""
            return f"{lines[i]} ({note})" if note else lines[i]
    if (hint := next((i for i, line in enumerate(lines) if line.startswith(_HYDRA_HINT)), None)) is not None:
        start = hint
        while start > 0 and not _BEFORE_HYDRAS_MESSAGE.match(lines[start - 1]):
            start -= 1
        return " ".join(lines[start:hint][:3])
    errors = [line for line in lines if re.search(r"(Error|Exception|error:)", line) and "Warning" not in line]
    return (errors or lines or ["(no output)"])[-1]
