"""Runs of verl's real trainer (`python -m verl.trainer.main_ppo`) on CPU for the tests, through the module
behind `odc-grpo-cpu`: each run in its own process tree, its metrics what verl's `file` logger wrote."""

from __future__ import annotations

import contextlib
import os
import re

from odc_plugin.verl.ab_report import read_metrics
from odc_plugin.verl.cpu import grpo, runner
from tests.verl import golden
from tests.verl.golden import relative_difference

RANKS = 2
RUN_TIMEOUT_S = 900


class Trained:
    def __init__(self, result: grpo.RunResult):
        self.result = result
        self.metrics = read_metrics(result.metrics_file) if os.path.exists(result.metrics_file) else {}

    def log(self) -> str:
        with open(self.result.log_file, encoding="utf-8", errors="replace") as fp:
            return fp.read()

    def assert_ok(self, steps: int) -> None:
        assert self.result.returncode == 0, grpo.last_error(self.result.log_file)
        assert sorted(self.metrics) == list(range(1, steps + 1))
        assert not runner.ray_processes(self.result.ray_dir), "processes of the run were left behind"

    def assert_refused_at_start(self, error: str) -> None:
        """The run failed with a last error line ending in `error`, before any step and before any worker built
        an engine, and left no process behind."""
        assert self.result.returncode != 0 and self.result.steps == 0 and not self.metrics
        assert grpo.last_error(self.result.log_file).endswith(error)
        assert "odc: ODCEngine" not in self.log()
        assert not runner.ray_processes(self.result.ray_dir), "processes of the run were left behind"


def train(
    out,
    assets,
    name: str,
    strategy: str,
    steps: int,
    overrides=(),
    timeout_s=RUN_TIMEOUT_S,
    ranks: int = RANKS,
    slow_ranks: str | None = None,
) -> Trained:
    """One run of `strategy` with odc-grpo-cpu's settings plus `overrides`, in `out/name`."""
    run_dir = out / name
    run_dir.mkdir(exist_ok=True)
    args = grpo.run_args(
        grpo.settings(assets, ranks, steps, str(run_dir)),
        strategy,
        list(overrides),
        str(run_dir / f"{strategy}.jsonl"),
        slow_ranks,
    )
    result = grpo.run_trainer(strategy, args, str(run_dir), steps, timeout_s, echo=lambda _: None)
    # a record of every e2e run's cost, next to the runs
    with open(out / "runs.txt", "a") as fp:
        fp.write(
            f"{name}/{strategy}: {result.steps} steps in {result.wall_s:.0f} s, "
            f"peak memory {result.peak_pss_gib:.2f} GiB\n"
        )
    return Trained(result)


def ray_session(log_file) -> str | None:
    """The Ray session directory of a run that has started (its log's first line is the command, which
    names it), None before that: the one session whose processes are this run's."""
    with contextlib.suppress(OSError):
        with open(log_file, encoding="utf-8") as fp:
            match = re.search(r"_temp_dir=(\S+)", fp.readline())
            return match.group(1) if match else None
    return None


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def worst_difference(
    fsdp2: dict[int, dict],
    odc: dict[int, dict],
    steps: int,
    compared: tuple[str, ...],
    required: tuple[str, ...],
    rtol=lambda key: golden.RTOL,
) -> tuple[float, str]:
    """Per step, the rollouts (golden.EXACT) must be the same and every metric of `compared` that fsdp2's run
    reports, `required` among them, equal to `rtol(metric)`; returns the worst relative difference and where."""
    worst, where = 0.0, ""
    for step in range(1, steps + 1):
        a, b = fsdp2[step], odc[step]
        for key in golden.EXACT:
            assert a[key] == b[key], (step, key, a[key], b[key])
        present = [key for key in compared if key in a]
        assert set(required) <= set(present), (step, sorted(set(required) - set(present)))
        for key in present:
            difference = relative_difference(a[key], b[key])
            assert difference <= rtol(key), f"step {step} {key}: fsdp2 {a[key]!r}, odc {b[key]!r}"
            if difference >= worst:
                worst, where = difference, f"{key} step {step}"
    return worst, where
