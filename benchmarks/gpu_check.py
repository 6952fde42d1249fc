"""The GPU check: `odc-check` and the GPU tests and benchmarks on this machine, one report file.

    python3 benchmarks/gpu_check.py                  # from the repository root, on a GPU machine
    python3 benchmarks/gpu_check.py --only streams memory
    python3 benchmarks/gpu_check.py --dry-run        # anywhere: the steps, their commands, the files they need
    python3 benchmarks/gpu_check.py --dry-run --collect   # and how many tests each pytest selection collects

The steps (STEPS) are commands run from the repository root in this interpreter's environment, each under
its own time limit and all within --budget-s, so that one hang cannot eat the rest: first the versions,
then the correctness steps side by side (they take no timings), then the timed steps one at a time with
the GPU to themselves. A step that fails does not stop the others; the verl steps are skipped where verl
is not installed. The report (--report, default gpu_check_report.md) holds every step's result, time and
output tail, and is rewritten after every step, so it is there however the run ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
# a GPU machine runs it from a checkout, the plugin not necessarily installed: its own code from the checkout
sys.path.insert(0, str(ROOT))

from odc_plugin.launch import RankFailed, run_ranks, stop_group  # noqa: E402

BUDGET_S = 540
REPORT_NAME = "gpu_check_report.md"
DEVICE_ENV = "ODC_TEST_DEVICE"  # tests/verl/harness.py's DEVICE_ENV

Phase = Literal["setup", "correctness", "timed"]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    """What `--only` and the report call it."""
    what: str
    """One line for the report: what it checks."""
    argv: tuple[str, ...]
    """The command, run from the repository root; `python` is this interpreter."""
    timeout_s: int
    """Its own limit; the run's remaining budget lowers it."""
    phase: Phase
    """`setup`: first, one at a time; `correctness`: then side by side (no timings); `timed`: last, one at
    a time, with nothing else on the machine."""
    needs_verl: bool = False
    """Skipped (said so in the report) where verl is not installed; run with ODC_TEST_DEVICE=cuda, which
    puts the verl tests' ranks on GPUs."""


PYTEST = ("python", "-m", "pytest", "-q", "-rs", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts=")
STEPS = (
    Step(
        "versions",
        "Python, torch, CUDA, NCCL, the GPUs and driver, the packages, the commit",
        ("python", "benchmarks/gpu_check.py", "--versions"),
        60,
        "setup",
    ),
    Step(
        "correctness",
        "tests/comm's GPU tests (kernels, cuda_ipc conformance, the peer-atomics probe), ODC's core over CUDA IPC",
        PYTEST + ("-n", "4", "tests/comm", "tests/fsdp/test_odc_core.py", "-k", "gpu or cuda or interp"),
        240,
        "correctness",
    ),
    Step(
        "shared-gpu",
        "what a group of two ranks on one GPU can do (the engine tests' ranks share a GPU where there are few)",
        ("python", "benchmarks/gpu_check.py", "--shared-gpu"),
        90,
        "correctness",
    ),
    Step(
        "verl-engine",
        "verl's odc engine tests against fsdp2, ranks sharing the GPU (gloo group), ODC over cuda_ipc",
        PYTEST
        + ("-n", "3", "--dist", "loadfile", "tests/verl/test_odc_engine.py", "tests/verl/test_odc_engine_failures.py")
        + ("tests/verl/test_odc_hsdp_engine.py",),
        300,
        "correctness",
        needs_verl=True,
    ),
    Step(
        "verl-engine-nccl",
        "verl's odc engine against fsdp2, one rank per GPU in verl's NCCL group, transport auto",
        PYTEST + ("tests/verl/test_odc_engine_gpu.py",),
        240,
        "correctness",
        needs_verl=True,
    ),
    Step(
        "odc-check",
        "odc-check with 2 ranks (the peer-adds check, transport, correctness, compute, memory after offload)",
        ("python", "-m", "odc_plugin.check", "--gpus", "2"),
        180,
        "timed",
    ),
    Step(
        "streams",
        "the lagging reduce-scatter stream, with the stream bookkeeping and without (negative control)",
        PYTEST + ("-s", "tests/fsdp/test_odc_streams.py"),
        120,
        "timed",
    ),
    Step(
        "memory",
        "the backward's peak against stock FSDP2 under lagging streams, and the rebuild after expandable segments",
        ("python", "benchmarks/bench_memory_gpu.py"),
        150,
        "timed",
    ),
    Step(
        "transport",
        "gather and accumulate at 2 and 3 ranks, the old kernel against the new and slots, grid bounds 64/96/128",
        ("python", "benchmarks/bench_transport_gpu.py", "--gib", "1", "--worlds", "2", "3")
        + ("--programs", "64", "96", "128"),
        180,
        "timed",
    ),
    Step(
        "core",
        "ODC over stock FSDP2 at world size 1, Qwen2.5-0.5B bf16, trained and forward-only, and memory",
        ("python", "benchmarks/bench_odc_core.py", "--device", "cuda", "--ranks", "1", "--skews", "1")
        + ("--model-size", "Qwen2.5-0.5B", "--rows", "fsdp2+lb_micro", "odc+lb_micro", "--mixed-precision")
        + ("--base-len", "4096", "--steps", "10", "--forward-only"),
        180,
        "timed",
        needs_verl=True,  # LB-Mini's plan packs micro-batches with verl's own functions
    ),
)
PHASES: tuple[Phase, ...] = ("setup", "correctness", "timed")


@dataclasses.dataclass
class Result:
    status: str = "pending"
    seconds: float = 0.0
    limit_s: float = 0.0
    command: str = ""
    output: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# --------------------------------------------------------------------------------------------- steps


def step_files(step: Step) -> list[str]:
    """The repository paths a step's command names (a pytest node id counts by its file)."""
    files = []
    for previous, arg in zip(("",) + step.argv, step.argv):
        if arg.startswith("-") or previous == "-k":
            continue
        if arg.endswith(".py") or "/" in arg:
            files.append(arg.split("::")[0])
    return files


def is_pytest(step: Step) -> bool:
    return step.argv[1:3] == ("-m", "pytest")


def expand(step: Step) -> list[str]:
    return [sys.executable if arg == "python" else arg for arg in step.argv]


def step_env(step: Step) -> dict[str, str]:
    """This environment, with the repository first on the path (its `tests` before any installed one)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if step.needs_verl:
        env[DEVICE_ENV] = "cuda"
    return env


def has_verl() -> bool:
    return importlib.util.find_spec("verl") is not None


def select(names: list[str] | None) -> tuple[Step, ...]:
    """The steps named (all when none), and the set-up steps, which every run needs."""
    if not names:
        return STEPS
    known = [s.name for s in STEPS]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"gpu_check.py: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(known)}")
    return tuple(s for s in STEPS if s.name in names or s.phase == "setup")


# --------------------------------------------------------------------------------------------- dry run


def count_collected(step: Step) -> tuple[int, int]:
    """(tests the step's pytest selection collects, pytest's exit code), collected in the step's environment."""
    args = [a for a in step.argv[3:] if a != "-s"]  # after `python -m pytest`
    for option in ("-n", "--dist"):  # xdist's: collection runs in the one process
        while option in args:
            del args[args.index(option) : args.index(option) + 2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--collect-only"],
        cwd=ROOT,
        env=step_env(step),
        capture_output=True,
        text=True,
    )
    return sum("::" in line for line in proc.stdout.splitlines()), proc.returncode


def dry_run(steps: tuple[Step, ...], collect: bool) -> int:
    """Lists the steps; 1 if a step names a file that does not exist or (--collect) a pytest selection
    collects no test."""
    os.chdir(ROOT)  # the steps' paths are the repository's
    bad = []
    print(f"gpu_check.py --dry-run: {len(steps)} steps, budget {BUDGET_S} s, from {ROOT}")
    for step in steps:
        shown = " ".join(repr(a) if " " in a else a for a in step.argv)
        needs = ", needs verl" if step.needs_verl else ""
        print(f"step {step.name} [{step.phase}, {step.timeout_s} s{needs}]: {step.what}\n  {shown}")
        missing = [f for f in step_files(step) if not (ROOT / f).exists()]
        if missing:
            bad.append(step.name)
            print(f"  MISSING: {', '.join(missing)}")
        if collect and is_pytest(step):
            count, code = count_collected(step)
            print(f"  collects {count} tests (pytest exit {code})")
            if count < 1 or code != 0:
                bad.append(step.name)
    if bad:
        print(f"gpu_check.py --dry-run: steps with missing files or no tests: {', '.join(bad)}")
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------- the run


class Runner:
    """Runs steps as process groups with their own limits, and rewrites the report after each."""

    def __init__(self, steps: tuple[Step, ...], report: Path, work: Path, budget_s: float = BUDGET_S):
        self.steps, self.report, self.budget_s = steps, report, budget_s
        self.logs = work / "logs"
        self.logs.mkdir()
        self.results = {s.name: Result() for s in steps}
        self.start = time.monotonic()
        self.started_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        self.running: dict[str, tuple[subprocess.Popen, float, float]] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, line: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {line}", flush=True)

    def launch(self, step: Step) -> None:
        result = self.results[step.name]
        reason = "skipped: verl is not installed" if step.needs_verl and not has_verl() else None
        left = self.budget_s - self.elapsed()
        if reason is None and left < 5:
            reason = f"not run: the run's {self.budget_s:.0f} s were spent"
        if reason is not None:
            result.status = reason
            self.say(f"{step.name}: {reason}")
            return
        argv = expand(step)
        result.command = " ".join(argv)
        result.limit_s = min(step.timeout_s, left)
        with open(self.logs / f"{step.name}.log", "wb") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=step_env(step),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: a timeout ends the ranks it started
                )
            except OSError as e:
                result.status = f"failed to start: {e}"
                self.say(f"{step.name}: {result.status}")
                return
        self.running[step.name] = (proc, time.monotonic(), result.limit_s)
        self.say(f"{step.name}: started (limit {result.limit_s:.0f} s)")

    def poll(self) -> None:
        for name, (proc, started, limit) in list(self.running.items()):
            seconds = time.monotonic() - started
            if proc.poll() is None and seconds <= limit:
                continue
            result = self.results[name]
            if proc.returncode is None:
                stop_group(proc)
                result.status = f"timed out after {limit:.0f} s"
            else:
                result.status = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            result.seconds = seconds
            result.output = (self.logs / f"{name}.log").read_text(errors="replace")
            del self.running[name]
            self.say(f"{name}: {result.status} in {seconds:.1f} s; {last_line(result.output)}")
            self.write_report()

    def run_together(self, steps: list[Step]) -> None:
        for step in steps:
            self.launch(step)
        self.write_report()
        while self.running:
            time.sleep(0.5)
            self.poll()

    def run(self) -> bool:
        self.say(f"gpu_check.py: {len(self.steps)} steps, budget {self.budget_s:.0f} s, report {self.report}")
        self.write_report()
        try:
            for phase in PHASES:
                steps = [s for s in self.steps if s.phase == phase]
                if phase == "correctness":
                    self.run_together(steps)
                else:
                    for step in steps:
                        self.run_together([step])
        finally:  # stopped itself (SIGTERM, Ctrl-C) or broken: end what runs, and say so in the report
            for name, (proc, started, _) in list(self.running.items()):
                stop_group(proc)
                result = self.results[name]
                result.status, result.seconds = "stopped with the check", time.monotonic() - started
                result.output = (self.logs / f"{name}.log").read_text(errors="replace")
            for result in self.results.values():
                if result.status == "pending":
                    result.status = "not run: the check was stopped before it"
            self.write_report()
        summary = [f"  {s.name:<18}{self.results[s.name].status}" for s in self.steps]
        self.say("summary:\n" + "\n".join(summary) + f"\nreport: {self.report}")
        return all(r.passed for r in self.results.values())

    def write_report(self) -> None:
        lines = [
            "# GPU check report (benchmarks/gpu_check.py)",
            "",
            f"Started {self.started_at} on {socket.gethostname()}; {self.elapsed():.0f} s so far of a "
            f"{self.budget_s:.0f} s budget. Versions: step `versions`. Output of each step: its last lines (all of a "
            "failed step's, up to 600 lines).",
            "",
            "| step | check | result | seconds | limit | last line |",
            "| --- | --- | --- | ---: | ---: | --- |",
        ]
        for step in self.steps:
            r = self.results[step.name]
            row = [step.name, step.what, r.status, f"{r.seconds:.1f}", f"{r.limit_s:.0f}", last_line(r.output)]
            lines.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
        for step in self.steps:
            r = self.results[step.name]
            if not r.command:
                continue
            keep = 80 if r.passed else 600
            lines += ["", f"## {step.name}: {r.status}, {r.seconds:.1f} s", "", f"`{r.command}`", "", "```"]
            lines += [*tail(r.output, keep), "```"]
        self.report.parent.mkdir(parents=True, exist_ok=True)
        self.report.write_text("\n".join(lines) + "\n")


def tail(text: str, lines: int) -> list[str]:
    return text.rstrip("\n").splitlines()[-lines:]


def last_line(text: str) -> str:
    """The output's last non-empty line (pytest's summary, a benchmark's last figure), shortened."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()[:160]
    return ""


# --------------------------------------------------------------------------------------------- step helpers


def tree_commit(git: str | None) -> str:
    """The commit here, and whether the tree that runs differs from it."""
    if not git:
        return "no git here"
    head = subprocess.run([git, "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        return "no git metadata here"
    changed = subprocess.run([git, "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    count = len(changed.stdout.splitlines())
    return head.stdout.strip() + (f", {count} tracked files changed" if count else "")


def print_versions() -> None:
    """The `versions` step: what this machine runs."""
    import importlib.metadata as md
    import platform

    import torch

    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, host {socket.gethostname()}")
    git = shutil.which("git")
    print(f"repository: {tree_commit(git)}")
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    nccl = nccl_version() if torch.cuda.is_available() else "-"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(
            f"GPU {i}: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / (1 << 30):.1f} GiB, "
            f"sm_{p.major}{p.minor}"
        )
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        print(f"driver {out.stdout.strip()}")
    names = ["triton", "transformers", "tokenizers", "peft", "accelerate", "huggingface-hub", "safetensors", "regex"]
    names += ["numpy", "pyarrow", "pandas", "pytest", "pytest-xdist", "nvidia-nccl-cu13", "nvidia-nvshmem-cu13", "verl"]
    print("packages: " + ", ".join(f"{n} {_version(md, n)}" for n in names))


def _version(md, name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


def nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int before
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _all_reduce_on_gpu0(rank, world_size):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return t.item()


def _all_gather_on_gpu0(rank, world_size):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    out = torch.empty(world_size, device="cuda")
    dist.all_gather_into_tensor(out, torch.full((1,), float(rank), device="cuda"))
    return out.tolist()


def _full_tensor_on_gpu0(rank, world_size):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world_size,))
    return distribute_tensor(torch.arange(float(world_size), device="cuda"), mesh, [Shard(0)]).full_tensor().tolist()


# (group backend, what is tried, the rank function): the NCCL case decides whether the engine tests' ranks
# that share a GPU can use verl's own group; the gloo cases say which of their collectives gloo then
# carries (DTensor.full_tensor is what verl's weight export and the tests' state reads call).
SHARED_GPU_CASES = (
    ("nccl", "all_reduce", _all_reduce_on_gpu0),
    ("gloo", "all_gather_into_tensor (c10d) of CUDA tensors", _all_gather_on_gpu0),
    ("gloo", "DTensor.full_tensor() on a CUDA mesh (functional all-gather)", _full_tensor_on_gpu0),
)


def shared_gpu() -> int:
    """The `shared-gpu` step: each of SHARED_GPU_CASES in a pair of ranks of its own on GPU 0. Every answer
    is a finding (printed, a refusal or a crash included); exit 1 only when nothing could be checked."""
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing checked")
        return 1
    print(f"torch {torch.__version__}, NCCL {nccl_version()}, two ranks on GPU 0 ({torch.cuda.get_device_name(0)}):")
    for backend, what, fn in SHARED_GPU_CASES:
        try:
            result = run_ranks(fn, 2, backend=backend, timeout_s=60, pg_timeout_s=30)
        except RankFailed as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            reason = next((line for line in lines if "Duplicate GPU" in line), lines[0] if lines else "")
            print(f"  {backend} {what}: FAILS: {reason}")
            continue
        print(f"  {backend} {what}: works, rank results {result}")
    return 0


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="list the steps and check the files they name")
    p.add_argument("--collect", action="store_true", help="with --dry-run: count each pytest selection's tests")
    p.add_argument("--report", type=Path, default=Path(REPORT_NAME), help=f"the report file (default {REPORT_NAME})")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"all steps' time limit (default {BUDGET_S})")
    p.add_argument("--only", nargs="+", metavar="STEP", help="run these steps (and the set-up steps) only")
    p.add_argument("--versions", action="store_true", help="the versions step")
    p.add_argument("--shared-gpu", action="store_true", help="the shared-gpu step")
    args = p.parse_args(argv)
    if args.collect and not args.dry_run:
        p.error("--collect goes with --dry-run")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.versions:
        print_versions()
        return 0
    if args.shared_gpu:
        return shared_gpu()
    steps = select(args.only)
    if args.dry_run:
        return dry_run(steps, args.collect)
    report = args.report.resolve()
    os.chdir(ROOT)

    def stopped(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    with tempfile.TemporaryDirectory(prefix="odc-gpu-check-") as work:
        return 0 if Runner(steps, report, Path(work), args.budget_s).run() else 1


if __name__ == "__main__":
    sys.exit(main())
