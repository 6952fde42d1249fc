"""One command for a lent GPU machine: every check of docs/gpu.md's checklist, one report file.

    python3 benchmarks/gpu_check.py                  # there, from the repository root, `.whl` carried along
    python3 benchmarks/gpu_check.py --only probe streams
    python3 benchmarks/gpu_check.py --dry-run        # anywhere: the steps, their commands, the files they need
    python3 benchmarks/gpu_check.py --dry-run --collect   # and how many tests each pytest selection collects
    python3 benchmarks/gpu_check.py --build-wheels   # here, with network: the wheel folder .whl/

The steps (STEPS) are commands run from the repository root, each under its own time limit and all within
BUDGET_S, so that one hang cannot eat the rest: first the set-up (the wheel folder installed into a folder
of this run's own, the versions printed), then the correctness steps side by side (they take no timings,
and the machine has 16 cores), then the timed steps one at a time with the GPU to themselves. A step that
fails does not stop the others. The report (`$OUT/gpu_check_report.md`, or --report PATH) holds every
step's result, time and output tail, and is rewritten after every step, so it is there however the run
ends.

Each step gets PYTHONPATH set to what it needs, replacing the caller's: the repository root, and for the
verl steps also the installed wheels (verl 0.9.1 and what its engine imports that the machine lacks,
with the transformers verl pins), the Ray stand-in (benchmarks/gpu_check_standins: Ray's wheel does not
fit in what may travel) and a link that makes `patches/` importable as `odc_patches`, as an install
would; those steps also set ODC_TEST_DEVICE=cuda (tests/verl/harness.py). The other steps see the
machine's own packages only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
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
STANDINS = ROOT / "benchmarks" / "gpu_check_standins"
WHEEL_DIR = ".whl"
BUDGET_S = 540
REPORT_NAME = "gpu_check_report.md"
DEVICE_ENV = "ODC_TEST_DEVICE"  # tests/verl/harness.py's DEVICE_ENV
# what may travel to the lent machine: the working tree and the carried wheel folder (/work/.library/device)
TRAVEL_LIMIT = 64 << 20

# What verl 0.9.1's engine path imports that the lent machine lacks (its package list:
# /work/.library/device/KINDS.md), found by importing tests/verl/harness.py's path with those packages
# alone; at the versions this project's CPU suite runs. Ray and TransferQueue are not among them: Ray
# has a stand-in, and verl replaces TransferQueue by a mock of its own when it is missing. transformers,
# tokenizers, peft and regex shadow the machine's own in the verl steps only: verl 0.9.1 asks for
# transformers <5.11 (the machine has 5.17), whose import checks tokenizers <=0.23.0 and regex >=2025.10.22.
WHEELS = (
    "verl==0.9.1",
    "tensordict==0.10.0",
    "pyvers==0.1.0",
    "orjson==3.13.0",
    "omegaconf==2.3.1",
    "codetiming==1.4.0",
    "pydantic==2.13.4",
    "pydantic-core==2.46.4",
    "typing-inspection==0.4.2",
    "annotated-types==0.7.0",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "opentelemetry-api==1.45.2",
    "datasets==5.2.0",
    "multiprocess==0.70.19",
    "dill==0.4.1",
    "transformers==5.10.4",
    "tokenizers==0.22.2",
    "peft==0.21.2",
    "regex==2026.5.9",
)
# omegaconf's parser runtime: PyPI has no wheel of it, so it is built here (pure Python)
SDISTS = ("antlr4-python3-runtime==4.9.3",)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

Phase = Literal["setup", "correctness", "timed"]
Env = Literal["tree", "verl"]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    """What `--only` and the report call it."""
    what: str
    """One line for the report: the check, and its item in /work/shared/gpu-checklist.md."""
    argv: tuple[str, ...]
    """The command, run from the repository root; `python` is this interpreter, `{site}` the folder the
    wheels are installed into, `{wheels}` the wheel files."""
    timeout_s: int
    """Its own limit; the run's remaining budget lowers it."""
    phase: Phase
    """`setup`: first, one at a time; `correctness`: then side by side (no timings); `timed`: last, one at
    a time, with nothing else on the machine."""
    env: Env = "tree"
    """`tree`: the repository on the path; `verl`: also the wheels, the Ray stand-in, `odc_patches`, and
    ODC_TEST_DEVICE=cuda."""
    needs_wheels: bool = False
    """Skipped (said so in the report) when the wheel folder did not install."""


PYTEST = ("python", "-m", "pytest", "-q", "-rs", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts=")
STEPS = (
    Step(
        "wheels",
        "the wheel folder installed (verl and what its engine imports), for the verl steps only",
        ("python", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir")
        + ("--upgrade", "--target", "{site}", "{wheels}"),
        120,
        "setup",
    ),
    Step(
        "versions",
        "Python, torch, CUDA, NCCL, the GPU and driver, the packages; those the wheels put first for verl",
        ("python", "benchmarks/gpu_check.py", "--versions", "{site}"),
        60,
        "setup",
    ),
    Step(
        "correctness",
        "item 1: tests/comm's GPU tests (kernels, cuda_ipc conformance) and the ODC core tests over CUDA IPC",
        PYTEST
        + ("-n", "4", "tests/comm", "tests/fsdp/test_odc_core.py", "-k", "(gpu or cuda or interp) and not probe"),
        240,
        "correctness",
    ),
    Step(
        "shared-gpu",
        "item 8's set-up: what a group of two ranks on one GPU can do (the engine tests' ranks share it)",
        ("python", "benchmarks/gpu_check.py", "--shared-gpu"),
        90,
        "correctness",
    ),
    Step(
        "verl-engine",
        "item 8: verl's odc engine tests against fsdp2, ranks sharing the GPU (gloo group), ODC over cuda_ipc",
        PYTEST
        + ("-n", "3", "--dist", "loadfile", "tests/verl/test_odc_engine.py", "tests/verl/test_odc_engine_failures.py")
        + ("tests/verl/test_odc_hsdp_engine.py",),
        300,
        "correctness",
        env="verl",
        needs_wheels=True,
    ),
    Step(
        "verl-engine-nccl",
        "item 8: verl's odc engine against fsdp2, one rank per GPU in verl's NCCL group, transport auto",
        PYTEST + ("tests/verl/test_odc_engine_gpu.py",),
        240,
        "correctness",
        env="verl",
        needs_wheels=True,
    ),
    Step(
        "odc-check",
        "item 9: odc-check with 2 ranks sharing the GPU (gloo's collectives: NCCL takes one rank per GPU)",
        ("python", "-m", "odc_plugin.check", "--gpus", "2"),
        180,
        "timed",
        env="verl",  # the planner's prediction packs with verl's own functions
        needs_wheels=True,
    ),
    Step(
        "probe",
        "item 6: cuda_ipc's start-up peer-atomics probe passes, and its time",
        PYTEST + ("-s", "tests/comm/test_gpu_cuda_ipc.py", "-k", "probe"),
        90,
        "timed",
    ),
    Step(
        "streams",
        "item 1: the lagging reduce-scatter stream, with the stream bookkeeping and without (negative control)",
        PYTEST + ("-s", "tests/fsdp/test_odc_streams.py"),
        120,
        "timed",
    ),
    Step(
        "memory",
        "item 7: ODC's memory against stock FSDP2, after offload (as before the rollout) and the backward's peak",
        ("python", "benchmarks/bench_memory_gpu.py"),
        150,
        "timed",
    ),
    Step(
        "transport",
        "item 2: gather and accumulate at 2 and 3 ranks, old kernel against new and slots, grid bounds 64/96/128",
        ("python", "benchmarks/bench_transport_gpu.py", "--gib", "1", "--worlds", "2", "3")
        + ("--programs", "64", "96", "128"),
        180,
        "timed",
    ),
    Step(
        "core",
        "item 3: ODC over stock FSDP2 at world size 1, Qwen2.5-0.5B bf16, trained and forward-only, and memory",
        ("python", "benchmarks/bench_odc_core.py", "--device", "cuda", "--ranks", "1", "--skews", "1")
        + ("--model-size", "Qwen2.5-0.5B", "--rows", "fsdp2+lb_micro", "odc+lb_micro", "--mixed-precision")
        + ("--base-len", "4096", "--steps", "10", "--forward-only"),
        180,
        "timed",
        env="verl",  # LB-Mini's plan packs micro-batches with verl's own functions
        needs_wheels=True,
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
        if arg.startswith("-") or "{" in arg or previous == "-k":
            continue
        if arg.endswith(".py") or "/" in arg:
            files.append(arg.split("::")[0])
    return files


def is_pytest(step: Step) -> bool:
    return step.argv[1:3] == ("-m", "pytest")


def expand(step: Step, site: Path, wheels: list[str]) -> list[str]:
    argv = []
    for arg in step.argv:
        if arg == "python":
            argv.append(sys.executable)
        elif arg == "{wheels}":
            argv.extend(wheels)
        else:
            argv.append(arg.replace("{site}", str(site)))
    return argv


def wheel_files() -> list[str]:
    """The carried wheel files, as paths from the repository root (where the steps run)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / WHEEL_DIR).glob("*.whl"))


def step_env(step: Step, site: Path, links: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    path = [str(ROOT)]
    if step.env == "verl":
        path += [str(STANDINS), str(site), str(links)]
        env[DEVICE_ENV] = "cuda"
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


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
    """(tests the step's pytest selection collects, pytest's exit code), in this process."""
    import pytest

    class Count:
        items = 0

        def pytest_collection_finish(self, session):
            Count.items = len(session.items)

    args, skip = [], 0
    for arg in step.argv[3:]:  # after `python -m pytest`
        if skip:
            skip -= 1
        elif arg in ("-n", "--dist"):  # xdist's: collection runs here
            skip = 1
        elif arg != "-s":
            args.append(arg)
    env = {DEVICE_ENV: "cuda"} if step.env == "verl" else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        code = pytest.main([*args, "--collect-only", "-qq"], plugins=[Count()])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Count.items, int(code)


def dry_run(steps: tuple[Step, ...], collect: bool) -> int:
    """Lists the steps; 1 if a step names a file that does not exist or (--collect) a pytest selection
    collects no test."""
    os.chdir(ROOT)  # the steps' paths are the repository's
    wheels = wheel_files()
    bad = []
    print(f"gpu_check.py --dry-run: {len(steps)} steps, budget {BUDGET_S} s, from {ROOT}")
    for step in steps:
        shown = " ".join(
            f"{WHEEL_DIR}/*.whl ({len(wheels)} here)" if a == "{wheels}" else repr(a) if " " in a else a
            for a in step.argv
        )
        print(f"step {step.name} [{step.phase}, {step.timeout_s} s, env {step.env}]: {step.what}\n  {shown}")
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
        self.site, self.links, self.logs = work / "site", work / "links", work / "logs"
        self.links.mkdir()
        self.logs.mkdir()
        (self.links / "odc_patches").symlink_to(ROOT / "patches")  # pyproject's package-dir for odc_patches
        self.wheels = wheel_files()
        self.results = {s.name: Result() for s in steps}
        self.start = time.monotonic()
        self.started_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        self.running: dict[str, tuple[subprocess.Popen, float, float]] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, line: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {line}", flush=True)

    def skip_reason(self, step: Step) -> str | None:
        if step.name == "wheels" and not self.wheels:
            return f"skipped: no wheel folder {WHEEL_DIR}/ (build it here with --build-wheels; docs/gpu.md)"
        if step.needs_wheels and not (self.site.is_dir() and any(self.site.glob("verl-*.dist-info"))):
            return "skipped: the wheel folder did not install verl (see step wheels)"
        return None

    def launch(self, step: Step) -> None:
        result = self.results[step.name]
        reason = self.skip_reason(step)
        left = self.budget_s - self.elapsed()
        if reason is None and left < 5:
            reason = f"not run: the run's {self.budget_s:.0f} s were spent"
        if reason is not None:
            result.status = reason
            self.say(f"{step.name}: {reason}")
            return
        argv = expand(step, self.site, self.wheels)
        result.command = " ".join(argv)
        result.limit_s = min(step.timeout_s, left)
        with open(self.logs / f"{step.name}.log", "wb") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=step_env(step, self.site, self.links),
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

    def stop(self, proc: subprocess.Popen) -> None:
        """End a step's process group: SIGTERM, then SIGKILL after 10 s."""
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait_s)
                return

    def poll(self) -> None:
        for name, (proc, started, limit) in list(self.running.items()):
            seconds = time.monotonic() - started
            if proc.poll() is None and seconds <= limit:
                continue
            result = self.results[name]
            if proc.returncode is None:
                self.stop(proc)
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
                self.stop(proc)
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
    """The commit git names here, and whether the tree that runs is that commit: the device tool copies the
    working tree, and the git metadata beside it can be older (on 2026-11-26 it named a commit 18 back)."""
    if not git:
        return "no git here"
    head = subprocess.run([git, "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        return "no git metadata here"
    changed = subprocess.run([git, "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    count = len(changed.stdout.splitlines())
    differs = f", but {count} tracked files differ from it: the tree that ran is not that commit" if count else ""
    return head.stdout.strip() + differs


def print_versions(site: str | None) -> None:
    """The `versions` step: what this machine runs, and what the installed wheels put first for verl."""
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
    names += ["numpy", "pyarrow", "pandas", "pytest", "pytest-xdist", "nvidia-nccl-cu13", "nvidia-nvshmem-cu13"]
    print("packages: " + ", ".join(f"{n} {_version(md, n)}" for n in names))
    if site and Path(site).is_dir():
        dists = sorted(f"{d.metadata['Name']} {d.version}" for d in md.distributions(path=[site]))
        print(f"first on the verl steps' path (the wheel folder, installed in {site}): " + ", ".join(dists))
    else:
        print("no wheel folder installed: the verl steps are skipped")


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

    from odc_plugin.launch import RankFailed, run_ranks

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


# --------------------------------------------------------------------------------------------- wheel folder


def pip_lines(folder: str) -> list[list[str]]:
    """The two pip commands (after `python3`) that fill `folder` with WHEELS and SDISTS: docs/gpu.md shows them."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    download = ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    download += ["--implementation", "cp", *platforms, "-d", folder, *WHEELS]
    return [download, ["-m", "pip", "wheel", "--no-deps", "--no-binary=:all:", "-w", folder, *SDISTS]]


def build_wheels() -> int:
    """Downloads WHEELS and builds SDISTS into a fresh .whl/ (here, with network); 1 if what would travel
    to the lent machine is over its 64 MiB."""
    folder = ROOT / WHEEL_DIR
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.whl"):  # one version of each: two stop the install there
        old.unlink()
    for line in pip_lines(WHEEL_DIR):
        print("python3 " + " ".join(line), flush=True)
        if subprocess.run([sys.executable, *line], cwd=ROOT).returncode:
            return 1
    wheels = sum(f.stat().st_size for f in folder.glob("*.whl"))
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True)
    tree = sum((ROOT / f).stat().st_size for f in listed.stdout.decode().split("\0") if f and (ROOT / f).is_file())
    total = wheels + tree
    print(
        f"{WHEEL_DIR}/: {len(list(folder.glob('*.whl')))} wheels, {wheels / 2**20:.1f} MiB; with the working tree "
        f"({tree / 2**20:.1f} MiB) {total / 2**20:.1f} MiB of the {TRAVEL_LIMIT >> 20} MiB that may travel"
    )
    return 0 if total <= TRAVEL_LIMIT else 1


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="list the steps and check the files they name")
    p.add_argument("--collect", action="store_true", help="with --dry-run: count each pytest selection's tests")
    p.add_argument("--report", type=Path, help=f"the report file (default: $OUT/{REPORT_NAME})")
    p.add_argument("--only", nargs="+", metavar="STEP", help="run these steps (and the set-up steps) only")
    p.add_argument("--build-wheels", action="store_true", help=f"build {WHEEL_DIR}/ here (needs network)")
    p.add_argument("--versions", nargs="?", const="", metavar="SITE", help="the versions step")
    p.add_argument("--shared-gpu", action="store_true", help="the shared-gpu step")
    args = p.parse_args(argv)
    if args.collect and not args.dry_run:
        p.error("--collect goes with --dry-run")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.versions is not None:
        print_versions(args.versions or None)
        return 0
    if args.shared_gpu:
        return shared_gpu()
    if args.build_wheels:
        return build_wheels()
    steps = select(args.only)
    if args.dry_run:
        return dry_run(steps, args.collect)
    report = args.report or (Path(os.environ["OUT"]) / REPORT_NAME if os.environ.get("OUT") else None)
    if report is None:
        sys.exit("gpu_check.py: give --report PATH (or set OUT, as the device tool does)")
    report = report.resolve()
    os.chdir(ROOT)

    def stopped(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    with tempfile.TemporaryDirectory(prefix="odc-gpu-check-") as work:
        return 0 if Runner(steps, report, Path(work)).run() else 1


if __name__ == "__main__":
    sys.exit(main())
