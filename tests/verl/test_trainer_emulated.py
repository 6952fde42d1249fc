"""verl's real trainer with layer compute emulated from the GPU fit (`odc-grpo-cpu --emulate --compare
fsdp2,lockstep,odc --slow-ranks 3:1.5`), at test scale: 4 ranks (at 2 the 8 responses of step 1 all scored
0, leaving no gradient to compare), tiny time scale, each real token standing for 64, 2 steps.

The three runs are verl's `main_ppo` in their own process trees; they see the same drawn response lengths
and the same rollouts (same weights at step 1), so their first updates are the same math: fsdp2 over
gloo, ODC's transport with FSDP's per-layer lockstep, and ODC with LB-Mini. A few minutes in all (each rank
a Ray worker that imports verl, on 2 cores); the measurements at scale are in docs/results.md ("verl's trainer
at 8, 16 and 32 ranks").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from odc_plugin.verl.ab_report import read_metrics
from odc_plugin.verl.cpu import grpo
from odc_plugin.verl.cpu.emulation import load_passes

ROOT = Path(__file__).resolve().parents[2]
FIT_FILE = str(ROOT / "configs" / "cost_fit" / "Qwen2.5-7B-H100.json")
RUNS = ("fsdp2", "lockstep", "odc")
RANKS = 4


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("emulated")
    args = ["--ranks", str(RANKS), "--steps", "2", "--compare", ",".join(RUNS), "--emulate", FIT_FILE]
    args += ["--slow-ranks", f"{RANKS - 1}:1.5"]  # docs/results.md's slow-rank series, here
    # 64 true tokens per real one (responses up to 256 tokens: long enough to answer, so rewards vary at
    # step 1); a time scale at which emulated compute is a small part of a step: the test checks the path
    args += ["--length-factor", "64", "--time-scale", "0.02", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "odc_plugin.verl.cpu.grpo", *args], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, out


def test_fsdp2_lockstep_and_odc_train_the_same_first_step(emulated):
    _, out = emulated
    runs = {r: read_metrics(str(out / f"{r}.jsonl")) for r in RUNS}
    for run, metrics in runs.items():
        assert sorted(metrics) == [1, 2], run
    first = {r: m[1] for r, m in runs.items()}
    for key in ("critic/score/mean", "response_length/mean"):  # the same drawn lengths and rollouts
        assert len({m[key] for m in first.values()}) == 1, key
    norms = [m["actor/grad_norm"] for m in first.values()]
    assert min(norms) > 0 and max(norms) - min(norms) <= 1e-3 * max(norms), norms


def test_lockstep_runs_verls_equal_micro_batch_steps_and_odc_its_own(emulated):
    _, out = emulated
    for run in ("fsdp2", "lockstep"):
        for phase, ranks in load_passes(str(out / f"{run}-passes")).items():
            for step in (0, 1):
                counts = {len(ranks[r][step]) for r in range(RANKS)}
                assert len(counts) == 1, (run, phase, step, counts)
    odc = load_passes(str(out / "odc-passes"))
    assert set(odc) == {"old_log_prob", "ref", "update_actor"}


def test_the_report_has_every_phase_and_says_what_was_emulated(emulated):
    stdout, out = emulated
    report = (out / "report.txt").read_text()
    assert "each to a length DRAWN from the rl profile" in stdout
    # the fit's decode sibling holds each response to a GPU server's time (4 servers, one a rank)
    assert "held until 4 GPU inference server(s) would have generated it" in stdout
    for run in RUNS:
        held = re.search(rf"rollout of {run}: (\d+) responses held to the decode model \(median [\d.]+ s", report)
        assert held and int(held.group(1)) == 2 * 4 * RANKS, (run, held)  # 2 steps of a prompt of 4 a rank
    rows = [line.split()[0] for line in report[report.index("per phase") :].splitlines()[2:] if line[:1].strip()]
    assert rows[:4] == ["old_log_prob", "ref", "update_actor", "training"]
    assert "EMULATED from Qwen2.5-7B" in report and "ODC+LB-Mini over lockstep" in report
    assert "control: the rollout" in report and "driver (odc): LB-Mini planning" in report
    assert "peak memory of the whole run (PSS): fsdp2" in report
    assert "limit: per pass the larger of its emulated work over the ranks' summed speeds" in report


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--emulate", "/nonexistent.json"], "cost calibration '/nonexistent.json' cannot be read"),
        (["--emulate", str(ROOT / "pyproject.toml")], "is not JSON"),
        (["--emulate", FIT_FILE, "--response-lengths", "/nonexistent.txt"], "--response-lengths: neither 'rl' nor"),
        (["--emulate", FIT_FILE, "--response-lengths", str(ROOT / "pyproject.toml")], "one integer length per line"),
        (["--emulate", FIT_FILE, "--length-factor", "0"], "--length-factor must be an integer >= 1, got 0"),
        (["--time-scale", "2"], "--time-scale needs --emulate"),
        (["--compare", "fsdp2,fsdp3"], "must be distinct runs out of fsdp2, lockstep, odc_lb_micro, odc"),
    ],
)
def test_a_bad_fit_or_length_profile_is_a_one_line_error(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        grpo.main(["--out", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and len([line for line in err if "error" in line]) == 1
    assert not list(tmp_path.glob("*.log"))  # nothing was started
