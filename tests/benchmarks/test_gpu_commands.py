"""The GPU checklist's benchmark commands (benchmarks/gpu_check.py's steps, and docs/gpu.md's others) on a
machine without a GPU: each one's arguments parse, the benchmarks import without a GPU or Triton, and say
so instead of measuring."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def checklist_commands() -> list[list[str]]:
    """The GPU checklist's benchmark commands that take arguments, as argument lists from the script on:
    the GPU check's steps (benchmarks/gpu_check.py), then those docs/gpu.md shows beside it."""
    steps = [list(s.argv[1:]) for s in load("gpu_check.py").STEPS if s.argv[1].startswith("benchmarks/bench")]
    section = (ROOT / "docs" / "gpu.md").read_text().split("Not in the GPU check:", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    lines = [line.removeprefix("PYTHONPATH=. ") for line in block.group(1).splitlines()]
    shown = [shlex.split(line)[1:] for line in lines if line.startswith("python benchmarks/")]
    return [c for c in steps if len(c) > 1] + shown


def load(script: str):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_command_of_the_checklist_parses():
    commands = checklist_commands()
    assert [Path(c[0]).name for c in commands] == ["bench_transport_gpu.py", "bench_odc_core.py", "calibrate_cost.py"]
    for command in commands:
        # --help last: argparse has checked every argument before it when it prints the help and exits 0
        out = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith("usage:"), (command, out.stderr[-2000:])


def test_the_transport_benchmark_reads_its_arguments():
    bench = load("bench_transport_gpu.py")
    (command,) = [c for c in checklist_commands() if c[0].endswith("bench_transport_gpu.py")]
    args = bench.parse_args(command[1:])
    assert (args.gib, args.worlds, args.programs) == (1.0, [2, 3], [64, 96, 128])
    assert bench.kernel_names(args.programs) == [
        "old",
        "new/64",
        "new/96",
        "new/128",
        "slots/64",
        "slots/96",
        "slots/128",
    ]
    with pytest.raises(SystemExit):
        bench.parse_args(["--programs", "0"])


def test_the_core_benchmark_reads_its_arguments_and_reports_memory():
    bench = load("bench_odc_core.py")
    (command,) = [c for c in checklist_commands() if c[0].endswith("bench_odc_core.py")]
    args = bench.parse_args(command[1:])
    assert args.model_size == ["Qwen2.5-0.5B"] and args.rows == ("fsdp2+lb_micro", "odc+lb_micro")
    assert args.device == "cuda" and args.ranks == 1 and args.forward_only
    assert bench.parse_args(["--rows", "odc+lb_mini", "fsdp2+lb_micro"]).rows == ("fsdp2+lb_micro", "odc+lb_mini")
    gib = 1 << 30
    memory = {
        "fsdp2+lb_micro": {"held": 2 * gib, "kept": 4 * gib, "rise": gib},
        "odc+lb_micro": {"held": 2 * gib + 3 * 2**20, "kept": 4 * gib, "rise": gib},
    }
    assert bench.memory_line(memory, 2**20) == (
        "  memory GiB: fsdp2+lb_micro held 2.00, peak 7.00; "
        "odc+lb_micro held 2.00 (+3.00 B/param over fsdp2+lb_micro), peak 7.00"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU prints")
def test_without_a_gpu_the_benchmarks_say_nothing_was_measured():
    for command in checklist_commands()[:2]:
        out = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 1 and "Nothing was measured." in out.stderr, (command, out.stderr[-2000:])
