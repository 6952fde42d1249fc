"""odc-check on CPU ranks (shm transport, gloo), as a user runs it: every section with figures measured in
the run, the JSON, odc_split's all-to-all and the engine settings it prints, ODC on uneven micro-batch counts
at 2 and 4 ranks, 2 ranks without --ranks, a slow link flipping the verdict, a pair losing its adds failing
the check, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from odc_plugin.check.cli import main
from odc_plugin.check.verdict import LayerShape, Verdict, balanced_overhead, layer_seconds
from odc_plugin.launch import RankFailed


def _odc_check(*argv, timeout_s=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "odc_plugin.check", *argv], capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("check") / "check.json"
    proc = _odc_check("--cpu", "--ranks", "4", "--json", str(path))
    return proc, json.loads(path.read_text()) if path.exists() else None


def test_four_cpu_ranks_print_every_section_and_write_the_json(four_ranks):
    proc, report = four_ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for section in ("environment", "start-up check of peer adds", "transport against gloo's", "correctness:"):
        assert section in out, out
    assert "memory: ODC holds" in out and out.strip().splitlines()[-1].startswith("odc-check: ODC's transport is")
    assert "Warning" not in proc.stderr
    # every printed figure is one the JSON holds, measured in this run
    c = report["calibration"]
    assert report["ranks"] == 4 and report["transport"] == "shm" and report["backend"] == "gloo"
    assert all(p["passed"] for p in report["probe"].values()) and sorted(report["probe"]) == ["direct", "slots"]
    assert f"ratio {c['all_gather_s'] / c['gather_s']:.2f}x" in out
    for method, seconds in c["accumulate_s"].items():
        assert f"accumulate {method:<7}{seconds * 1e3:8.2f} ms" in out
    assert c["chosen"] in c["accumulate_s"] and f"accumulate {c['chosen']:<7}" in out and "(chosen)" in out
    k = report["correctness"]
    assert k["passed"] and k["worst"] < k["limit"]
    assert k["odc_micro_batches"] == [9, 1, 1, 1] and k["fsdp_micro_batches"] == [3, 3, 3, 3]
    assert f"{k['worst']:.2e}" in out
    assert report["memory"]["odc_released_bytes"] < report["memory"]["odc_built_bytes"]
    assert report["verdict"]["line"] == out.strip().splitlines()[-1]
    # odc_split's all-to-all over the groups Qwen2.5-0.5B's 14 heads allow (2), two blocks of 2 at once: the
    # small message, then one layer's k or v and q of 4096 tokens a rank, bf16 (its 2 kv heads and 14 of 64)
    a = report["all_to_all"]
    assert (a["backend"], a["world_size"], list(a["seconds"])) == ("gloo", 4, ["2"])
    assert a["message_bytes"] == [2**16, 4096 * 128 * 2, 4096 * 896 * 2]
    assert all(t > 0 for t in a["seconds"]["2"]) and a["latency_s"]["2"] > 0 and a["bandwidth"]["2"] > 0
    assert (
        "Ulysses all-to-all (odc_split) over gloo, aligned groups of 2 ranks at once, 4096 tokens a rank of "
        "Qwen2.5-0.5B; slowest rank, median of 5\n"
        f"  k=2  latency {a['latency_s']['2'] * 1e6:9.1f} us   bandwidth {a['bandwidth']['2'] / 1e9:8.2f} GB/s   "
        f"(0.1 MiB {a['seconds']['2'][0] * 1e3:.3f} ms, 1.0 MiB "
    ) in out
    # the settings printed are ones the engine config takes
    settings = next(line for line in out.splitlines() if "odc_split_bandwidth=" in line).split(": ", 1)[1].split()
    assert settings == [
        f"odc_split_bandwidth={a['bandwidth']['2']:.3e}",
        f"odc_split_latency_s={a['latency_s']['2']:.3e}",
    ]
    assert float(settings[0].split("=")[1]) == pytest.approx(a["bandwidth"]["2"], rel=1e-3)


def test_two_ranks_train_odc_on_uneven_counts_and_a_slow_link_makes_the_verdict_say_odc_would_lose(tmp_path):
    # a short micro-batch computes in little time, so a link 0.2 s slower per transfer cannot hide behind it
    proc = _odc_check("--cpu", "--ranks", "2", "--micro-batch-tokens", "8", "--test-delay-s", "0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same 6 samples as FSDP2's 3 and 3, one rank running five times the other's micro-batches
    correctness = "correctness: Qwen2 'small', 3 SGD steps, ODC on micro-batch counts [5, 1] against stock FSDP2 on"
    assert f"{correctness} [3, 3]\n  worst relative difference" in proc.stdout and "same training" in proc.stdout
    # the all-to-all over both ranks, at 8 tokens' messages: a small one and one layer's k or v and q
    assert "Ulysses all-to-all (odc_split) over gloo, aligned groups of 2 ranks at once, 8 tokens a rank" in proc.stdout
    assert "(0.0 MiB " in proc.stdout and "odc_split_latency_s=" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert (
        last.startswith("odc-check: WARNING: ODC would lose here: ODC's transport is 0.") and "strategy=fsdp2" in last
    )


def test_a_pair_losing_its_adds_fails_the_check_and_exits_non_zero(tmp_path):
    path = tmp_path / "check.json"
    proc = _odc_check("--cpu", "--ranks", "3", "--test-lossy-pair", "1:2", "--json", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("FAILED: cuda_ipc") == 0
    for method in ("direct", "slots"):
        assert f"method '{method}': FAILED: shm: the start-up check of" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("odc-check: FAILED")
    report = json.loads(path.read_text())
    assert not any(p["passed"] for p in report["probe"].values()) and "calibration" not in report


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "say where to run: --gpus N, --cpu [--ranks N]"),
        (["--cpu", "--ranks", "1"], "--ranks: must be an integer >= 2, got '1'"),
        (["--ranks", "2"], "--ranks goes with --cpu"),
        (["--cpu", "--ranks", "2", "--model", "no-such-model"], "--model: model 'no-such-model' is neither a preset"),
        (["--cpu", "--ranks", "2", "--micro-batch-tokens", "0"], "--micro-batch-tokens: must be an integer >= 1"),
        (["--cpu", "--ranks", "2", "--json", "."], "--json . is a directory"),
        (["--cpu", "--ranks", "2", "--test-lossy-pair", "1:1"], "--test-lossy-pair must be SENDER:OWNER"),
        (["--cpu", "--gpus", "2"], "not allowed with argument"),
    ],
)
def test_bad_arguments_fail_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("odc-check: error: ") and message in err[-1], err


def test_cpu_alone_runs_two_ranks(monkeypatch, capsys):
    launched = []

    def run_ranks(fn, ranks, options, **kwargs):
        launched.append((ranks, options.device))
        raise RankFailed("stopped before the ranks start")

    monkeypatch.setattr("odc_plugin.launch.run_ranks", run_ranks)
    assert main(["--cpu"]) == 2 and launched == [(2, "cpu")]
    assert capsys.readouterr().err == "odc-check: stopped before the ranks start\n"


def test_the_verdict_weighs_the_balanced_overhead_against_the_planned_gain():
    # communication hidden under compute costs nothing; a gather slower than the compute costs its excess
    assert balanced_overhead(1.0, (0.5, 0.5), (0.2, 0.2)) == 0.0
    assert layer_seconds(1.0, 2.0, 1.0) == 2.0 + 3.0
    assert balanced_overhead(1.0, (2.0, 1.0), (0.5, 0.5)) == 5.0 / 3.0 - 1
    assert (
        not Verdict(
            1.2,
            "nccl",
            0.01,
            1.10,
        ).loses
        and Verdict(0.3, "nccl", 0.5, 1.2).loses
    )
    assert Verdict(0.3, "nccl", 0.5, 1.2).line().startswith("odc-check: WARNING: ODC would lose here")
    # without verl there is no prediction, and the line claims none
    unplanned = Verdict(1.2, "nccl", 0.01, None)
    assert unplanned.loses and "predicts" not in unplanned.line() and "needs verl" in unplanned.line()
    seven = LayerShape.of("Qwen2.5-7B")
    assert (seven.layers, seven.params) == (28, 233_046_016)
