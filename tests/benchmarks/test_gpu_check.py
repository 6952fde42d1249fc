"""benchmarks/gpu_check.py, the GPU check, on a machine without a GPU: its dry run names only files that exist
and pytest selections that collect tests; its runner goes on past a failing step, ends a hanging step's whole
process group at the step's limit, skips the verl steps without verl and what the budget no longer covers,
and writes the report; docs/gpu.md shows its steps as they are."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.verl import harness

from .test_gpu_commands import ROOT, load

check = load("gpu_check.py")


def test_the_dry_run_names_only_files_that_exist_and_every_pytest_selection_collects_tests():
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--collect"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    for step in check.STEPS:
        assert f"step {step.name} [" in out.stdout, step.name
    counts = [int(n) for n in re.findall(r"collects (\d+) tests \(pytest exit 0\)", out.stdout)]
    assert len(counts) == sum(map(check.is_pytest, check.STEPS)) and min(counts) >= 1, counts


def test_the_steps_fit_nine_minutes_and_run_in_this_environment_with_the_repository_first():
    names = [s.name for s in check.STEPS]
    assert len(set(names)) == len(names) and check.BUDGET_S <= 9 * 60
    assert [s.phase for s in check.STEPS] == sorted((s.phase for s in check.STEPS), key=check.PHASES.index)
    assert check.DEVICE_ENV == harness.DEVICE_ENV
    for step in check.STEPS:
        env = check.step_env(step)
        assert env["PYTHONPATH"].split(":")[0] == str(ROOT), step.name  # the repository's `tests` first
        assert (env.get(check.DEVICE_ENV) == "cuda") == step.needs_verl, step.name
    # odc-check measures the probe, compute beside accumulates and memory after offload: no step repeats them
    assert not [s.name for s in check.STEPS if "probe" in " ".join(s.argv)]


HANG = "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(60)"  # noqa: E501


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_failing_step_does_not_stop_the_others_and_a_hanging_one_ends_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "has_verl", lambda: False)
    pid_file = tmp_path / "child.pid"
    Step = check.Step
    steps = (
        Step("ok", "prints", ("python", "-c", "print('fine')"), 30, "setup"),
        Step("fails", "exits 3", ("python", "-c", "import sys; print('broken'); sys.exit(3)"), 30, "correctness"),
        Step("hangs", "sleeps, its child too", ("python", "-c", HANG, str(pid_file)), 2, "correctness"),
        Step("verl", "needs verl", ("python", "-c", "pass"), 30, "correctness", needs_verl=True),
        Step("late", "after the budget", ("python", "-c", "pass"), 30, "timed"),
    )
    (tmp_path / "work").mkdir()
    report = tmp_path / "out" / "report.md"
    # budget 7 s: the hanging step holds the run for its 2 s, so less than the 5 s a step needs is left after it
    assert not check.Runner(steps, report, tmp_path / "work", budget_s=7).run()
    text = report.read_text()
    for name, status in [
        ("ok", "passed"),
        ("fails", "failed (exit 3)"),
        ("hangs", "timed out after 2 s"),
        ("verl", "skipped: verl is not installed"),
        ("late", "not run: the run's 7 s were spent"),
    ]:
        assert re.search(rf"^\| {name} \| [^|]* \| {re.escape(status)}", text, re.M), (name, text)
    assert "fine" in text and "broken" in text
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the hanging step's child outlived the step"


def test_docs_gpu_md_shows_the_steps_of_the_command():
    doc = (ROOT / "docs" / "gpu.md").read_text()
    section = doc[doc.index("## The GPU check") :]
    table = section[section.index("| step |") : section.index("\n\n", section.index("| step |"))]
    assert re.findall(r"^\| ([\w-]+) \|", table, re.M)[2:] == [s.name for s in check.STEPS]  # after the header
