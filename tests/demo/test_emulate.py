"""Emulated layer compute (odc_plugin/layer_time.py) and the scale rehearsal it drives in odc-demo."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from odc_plugin.balance import FitCost
from odc_plugin.balance.common import minibatch_limit
from odc_plugin.balance.step_time import off_planner_note, simulate_minibatch, unbalanceable_note
from odc_plugin.demo import main
from odc_plugin.demo.config import DemoConfig
from odc_plugin.demo.rows import AUTO_ROW, ROWS
from odc_plugin.demo.run import run_demo
from odc_plugin.demo.sweep import odc_plan_speedups
from odc_plugin.demo.workload import draw_minibatches
from odc_plugin.layer_time import ComputeEmulator, EmulationFit, parse_slow_ranks

ROOT = Path(__file__).resolve().parents[2]
FIT_FILE = str(ROOT / "configs" / "cost_fit" / "Qwen2.5-7B-H100.json")
NOT_JSON = str(ROOT / "pyproject.toml")


def _timed_pass(layer, x):
    start = time.perf_counter()
    y = layer(x)
    middle = time.perf_counter()
    y.sum().backward()
    return middle - start, time.perf_counter() - middle


def _took(measured: float, target: float, slack: float) -> bool:
    """A sleep never ends early, so `target` bounds a pass from below exactly; above, the slack is the
    scheduler's (a busy machine wakes a sleeper late), kept below the gap to the next wrong answer."""
    return target - 1e-6 <= measured <= target + slack


def test_an_emulated_layer_takes_its_fitted_forward_and_backward_time():
    # 2 layers sharing 0.6 s per micro-batch: each 0.3 s, 0.1 s forward and 0.2 s backward
    fit = EmulationFit(
        FitCost(0.0, 0.6 / 1000), num_layers=1, backward_ratio=2.0, time_scale=1.0, model="test", source="test"
    )
    emulator = ComputeEmulator(fit, 1.0, num_layers=2)
    layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    emulator.attach(layers)
    emulator.micro_batch([600, 400])
    forward, backward = _timed_pass(layers[0], torch.randn(4, 8, requires_grad=True))
    # slack under 0.05 s: the slow rank's 1.5x would be 0.15 and 0.3
    assert _took(forward, 0.1, 0.04) and _took(backward, 0.2, 0.04), (forward, backward)
    slow = ComputeEmulator(fit, 1.5, num_layers=2)
    slow.attach(layers[1:] + [torch.nn.Linear(8, 8)])
    slow.micro_batch([1000])
    forward, backward = _timed_pass(layers[1], torch.randn(4, 8, requires_grad=True))
    # slack under 0.075 s: 1.5x applied twice would be 0.225 and 0.45
    assert _took(forward, 0.15, 0.06) and _took(backward, 0.3, 0.06), (forward, backward)


class _Sleeps(torch.nn.Module):
    """A layer whose own forward takes 0.1 s or, on a busy machine, a little more: `took` says how long."""

    took = 0.0

    def forward(self, x):
        start = time.perf_counter()
        time.sleep(0.1)
        self.took = time.perf_counter() - start
        return x * 2


def test_without_a_fit_a_slow_rank_takes_its_factor_times_the_measured_time():
    layer = _Sleeps()
    ComputeEmulator(None, 3.0, num_layers=1).attach([layer])
    forward, _ = _timed_pass(layer, torch.randn(4, requires_grad=True))
    # three times what the layer itself took; slack under 0.1 s, where a factor of four would be
    assert _took(forward, 3 * layer.took, 0.08), (forward, layer.took)


def test_the_planner_paces_lockstep_by_the_slow_rank_at_every_step_and_odc_only_at_the_end():
    plan = [[[0], [1]], [[2], [3]]]  # two ranks, two micro-batches each
    costs = [1.0, 1.0, 1.0, 1.0]
    assert simulate_minibatch(plan, costs, lockstep=True, slowdown=[1.5, 1.0]).seconds == 3.0
    assert simulate_minibatch(plan, costs, lockstep=False, slowdown=[1.0, 2.0]).seconds == 4.0
    with pytest.raises(ValueError, match="slowdown has 1 entries for 2 ranks"):
        simulate_minibatch(plan, costs, lockstep=False, slowdown=[1.0])


def test_an_8_rank_emulated_run_trains_every_sample_once_per_row_to_the_same_parameters(tmp_path):
    cfg = DemoConfig(
        ranks=8,
        steps=2,
        workload="rl",
        mini_batch_size=8,
        max_prompt_length=512,
        max_response_length=16384,
        max_token_len=16896,
        emulate=FIT_FILE,
        time_scale=0.05,
        slow_ranks="3:2",
        out_dir=str(tmp_path),
    )
    report = run_demo(cfg, quiet=True)
    assert report["config"]["model_size"] == "stand-in" and report["calibration"]["time_scale"] == 0.05
    for row, r in report["runs"].items():
        for k, batch in enumerate(draw_minibatches(cfg)):
            trained = sorted(seed for rank in r["samples_per_rank"][k] for seed in rank)
            assert trained == sorted(s.seed for s in batch), row
        assert len(r["predicted_step_s"]) == 2 and all(t > 0 for t in r["predicted_step_s"])
    assert report["max_param_diff"] < 1e-5
    assert report["config"]["slowdowns"] == [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    assert report["memory_mb"] > 0
    fit = EmulationFit.load(FIT_FILE, 0.05)
    for limit, batch in zip(report["limit_step_s"], draw_minibatches(cfg)):
        assert limit == minibatch_limit(fit.cost.costs([s.total for s in batch]), report["config"]["slowdowns"])
    for r in report["runs"].values():  # no row beats the limit (the real work between layers only adds)
        assert r["over_limit"] > 0
    with open(tmp_path / "odc_demo.json") as f:
        assert json.load(f)["factors"] == report["factors"]
    assert list(report["runs"]) == list(ROWS)


def test_the_auto_row_starts_from_flops_then_gives_a_slow_rank_less_work(tmp_path):
    cfg = DemoConfig(
        ranks=4,
        steps=3,
        workload="rl",
        mini_batch_size=8,
        max_prompt_length=512,
        max_response_length=16384,
        max_token_len=16896,
        emulate=FIT_FILE,
        time_scale=0.15,
        slow_ranks="1:2",
        cost="auto",
        out_dir=str(tmp_path),
    )
    report = run_demo(cfg, quiet=True)
    auto = report["runs"][AUTO_ROW]
    assert report["auto_fits"][0] is None  # no timings yet: the FLOPs prior planned the first mini-batch
    last = report["auto_fits"][-1]
    # the emulated 2x slowdown, found; at this small time scale the real (not slowed) work of a micro-batch
    # is a part of its time, more so on a busy machine, which pulls the estimate towards 1 (the fit's
    # accuracy is tested on synthetic timings in tests/balance/test_online_fit.py)
    assert last["speeds"][1] == pytest.approx(0.5, rel=0.2)
    for k in (1, 2):
        tokens = auto["tokens_per_rank"][k]
        assert tokens[1] < 0.75 * statistics.fmean(tokens[r] for r in (0, 2, 3)), tokens
    for k, batch in enumerate(draw_minibatches(cfg)):
        assert sorted(seed for rank in auto["samples_per_rank"][k] for seed in rank) == sorted(s.seed for s in batch)
    assert report["max_param_diff"] < 1e-5 and "auto" in report["factors"]


def test_a_sweep_point_writes_its_json_and_picture(tmp_path, capsys):
    main(
        [
            "--emulate",
            FIT_FILE,
            "--sweep-ranks",
            "4",
            "--workload",
            "rl",
            "--steps",
            "1",
            "--time-scale",
            "0.02",
            "--out-dir",
            str(tmp_path),
        ]
    )
    result = json.loads((tmp_path / "odc_sweep.json").read_text())
    (point,) = result["points"]
    assert (point["workload"], point["ranks"], point["samples_per_minibatch"]) == ("rl", 4, 16)
    assert set(point["rows"]) == set(ROWS) and point["headline"] > 0
    assert point["limit_step_s"] > 0 and all(r["over_limit"] > 0 for r in point["rows"].values())
    assert point["relative_error"] == pytest.approx(point["predicted_headline"] / point["headline"] - 1)
    assert (tmp_path / "odc_sweep.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "EMULATED" in out
    # the case's odc-plan figure is the planner's, computed for this fit and rank count
    planned = f"odc-plan (ODC+LB-Mini over FSDP+LB-Micro): {odc_plan_speedups(FIT_FILE, 'rl', [4])[4]:.2f}x at 4 ranks"
    assert planned in result["cases"]["rl"] and planned in out


def test_emulated_runs_default_to_the_time_scale_that_keeps_the_rehearsal_small():
    assert DemoConfig(ranks=2, emulate=FIT_FILE).time_scale == "auto"
    assert DemoConfig(ranks=2).time_scale == 1.0


def test_a_run_off_the_planner_says_so():
    assert off_planner_note({"odc+lb_mini": -0.05, "lockstep+lb_micro": 0.099}) is None
    note = off_planner_note({"odc+lb_mini": -0.05, "fsdp2+lb_micro": -0.31}, "row")
    assert note.startswith("more than 10% off the planner: fsdp2+lb_micro (-31.0%); the planner models compute only")


def _best_split(costs, slowdown):
    """The fastest any assignment of whole samples to ranks can be: every assignment tried."""
    best = float("inf")
    for owners in itertools.product(range(len(slowdown)), repeat=len(costs)):
        loads = [0.0] * len(slowdown)
        for cost, rank in zip(costs, owners):
            loads[rank] += cost
        best = min(best, max(load * f for load, f in zip(loads, slowdown)))
    return best


@pytest.mark.parametrize(
    "costs,slowdown,limit",
    [
        ([3, 3, 2, 2, 2], [1.0, 1.0], 6.0),  # the work over the summed speeds, reached
        ([9, 1, 1, 1], [1.0, 1.0, 1.0], 9.0),  # the longest sample, alone on a rank
        ([4, 2, 2, 2, 2], [1.0, 2.0], 8.0),  # a rank at half speed: 12 over 1.5
        ([6, 1, 1], [1.5, 1.0, 3.0], 6.0),  # the longest sample on the fastest rank
    ],
)
def test_the_limit_is_what_no_split_of_whole_samples_beats(costs, slowdown, limit):
    assert minibatch_limit(costs, slowdown) == pytest.approx(limit)
    assert _best_split(costs, slowdown) >= limit - 1e-12
    assert minibatch_limit(costs, slowdown, throughput=2.0) == pytest.approx(limit / 2)


def test_a_mini_batch_of_one_sample_per_rank_or_fewer_says_nothing_can_be_balanced():
    assert unbalanceable_note({"rl at 4 ranks": (16, 4)}) is None
    note = unbalanceable_note({"rl at 4 ranks": (16, 4), "sft at 32 ranks": (16, 32), "sft at 16 ranks": (16, 16)})
    assert note.startswith(
        "sft at 32 ranks (16 samples, 32 ranks), sft at 16 ranks (16 samples, 16 ranks): at most one sample per "
        "rank, so nothing can be balanced"
    )
    assert len(note.splitlines()) == 1


def test_slow_ranks_spec():
    assert parse_slow_ranks("3:1.5, 0:2", 4) == {3: 1.5, 0: 2.0}
    assert parse_slow_ranks(None, 4) == {}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--emulate", "/nonexistent.json"], "cost calibration '/nonexistent.json' cannot be read"),
        (["--emulate", NOT_JSON], f"cost calibration {NOT_JSON!r} is not JSON"),
        (["--slow-ranks", "1"], "--slow-ranks: '1' is not RANK:FACTOR (e.g. 3:1.5)"),
        (["--slow-ranks", "1:x"], "--slow-ranks: '1:x' is not RANK:FACTOR"),
        (["--ranks", "2", "--slow-ranks", "2:1.5"], "--slow-ranks: rank 2 is out of range for 2 ranks"),
        (["--slow-ranks", "0:0"], "--slow-ranks: factor of rank 0 must be a finite number > 0, got 0"),
        (["--slow-ranks", "0:2,0:3"], "--slow-ranks: rank 0 is given twice"),
        (["--sweep-ranks", "4"], "--sweep-ranks runs many ranks on this machine's cores: it needs --emulate"),
        (
            ["--emulate", FIT_FILE, "--sweep-ranks", "2", "4", "--slow-ranks", "3:2"],
            "--slow-ranks: rank 3 is out of range for 2 ranks",
        ),
        (["--time-scale", "2"], "--time-scale scales emulated compute: it needs --emulate"),
        (["--emulate", FIT_FILE, "--time-scale", "fast"], "must be a finite number > 0 or 'auto', got 'fast'"),
        (
            ["--emulate", FIT_FILE, "--time-scale", "-1"],
            "--time-scale: must be a finite number > 0 or 'auto', got '-1'",
        ),
    ],
)
def test_bad_emulation_options_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and len([line for line in err if "error" in line]) == 1
