"""The fit cost model's calibration: the relative least-squares fit, the calibration file, the CPU-sized
calibration run, and odc-plan reading its file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from odc_plugin.balance import FitCost, get_cost_model
from odc_plugin.balance.costs import CostCalibration, fit_quadratic
from odc_plugin.balance.planner import main as plan_main

SEQLENS = np.array([512, 1024, 2048, 4096, 8192, 16384, 32768])
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "calibrate_cost.py"


def calibration(**changes) -> CostCalibration:
    fields = {
        "model": "Qwen2.5-1.5B",
        "device": "NVIDIA H100 80GB HBM3",
        "dtype": "bf16",
        "a": 2e-11,
        "b": 3e-7,
        "unit": "seconds per layer",
        "points": [[512, 1.6e-4], [32768, 3.1e-2]],
        "max_rel_error": 0.02,
        "layer": {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2},
    }
    return CostCalibration(**(fields | changes))


def test_fit_recovers_exact_and_noisy_coefficients():
    a, b = 2e-11, 3e-7
    exact = a * SEQLENS**2 + b * SEQLENS
    assert fit_quadratic(SEQLENS, exact) == pytest.approx((a, b), rel=1e-9)
    noisy = exact * (1 + np.random.default_rng(0).normal(0, 0.02, len(SEQLENS)))
    fa, fb = fit_quadratic(SEQLENS.tolist(), noisy.tolist())
    assert fa == pytest.approx(a, rel=0.1) and fb == pytest.approx(b, rel=0.1)
    # Relative weighting: the shortest length, 1/4000 of the longest's time, is fitted as well as the rest.
    assert np.abs(FitCost(fa, fb).costs(SEQLENS) / noisy - 1).max() < 0.05


def test_fit_keeps_coefficients_non_negative():
    # Sub-quadratic growth: the unconstrained fit has a < 0, so the best b-only fit is the answer.
    t = SEQLENS * 1e-6 - SEQLENS**2 * 1e-11
    x = SEQLENS / t
    assert fit_quadratic(SEQLENS, t) == pytest.approx((0.0, x.sum() / (x @ x)), rel=1e-12)
    # Almost pure s^2 with a negative linear part: b = 0 and the best a-only fit.
    t = SEQLENS**2 * 1e-11 - SEQLENS * 1e-9
    x = SEQLENS**2 / t
    assert fit_quadratic(SEQLENS, t) == pytest.approx((x.sum() / (x @ x), 0.0), rel=1e-12)


@pytest.mark.parametrize(
    "seqlens,times,match",
    [
        ([1, 2], [1.0], "one time per sequence length, got 2 lengths and 1 times"),
        ([1, 2], [1.0, 0.0], "positive sequence lengths and times"),
        ([4, 4], [1.0, 1.1], "at least two distinct sequence lengths"),
    ],
)
def test_fit_errors(seqlens, times, match):
    with pytest.raises(ValueError, match=match):
        fit_quadratic(seqlens, times)


def test_calibration_file_round_trip(tmp_path):
    path = tmp_path / "fit.json"
    calibration().save(path)
    assert CostCalibration.load(path) == calibration()
    assert calibration().num_hidden_layers == 28 and calibration(model="mine").num_hidden_layers is None
    assert FitCost.from_file(path) == FitCost(2e-11, 3e-7) == get_cost_model("fit", file=str(path))
    with pytest.raises(ValueError, match="bad options for the 'fit' cost model"):
        get_cost_model("fit", file=str(path), a=1.0)


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "cannot be read"),
        ("{", "is not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"a": 1.0, "b": 2.0}), "lacks model, device, dtype, unit, points, max_rel_error, layer"),
        ({"a": "1e-11"}, "a must be a number >= 0, got '1e-11'"),
        ({"unit": "ms"}, "unit must be 'seconds per layer', got 'ms'"),
        ({"b": -1.0}, "b must be a number >= 0, got -1.0"),
    ],
)
def test_malformed_calibration_files(tmp_path, content, match):
    path = tmp_path / "fit.json"
    if isinstance(content, dict):
        calibration(**content).save(path)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        FitCost.from_file(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def load_script():
    spec = importlib.util.spec_from_file_location("calibrate_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calibration_runs_on_cpu_with_a_tiny_layer(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    tiny = ["--hidden-size", "64", "--intermediate-size", "96", "--heads", "4", "--kv-heads", "2"]
    script = load_script()
    result = script.main(
        ["--model", "Qwen2.5-1.5B", "--device", "cpu", "--dtype", "fp32", *tiny]
        + ["--seqlens", "128", "32", "64", "--iters", "2", "--warmup", "1", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert "measured ms" in printed and f"wrote {out}" in printed
    loaded = CostCalibration.load(out)
    assert loaded == result
    assert (loaded.model, loaded.device, loaded.dtype) == ("Qwen2.5-1.5B", "cpu", "fp32")
    assert [s for s, _ in loaded.points] == [32, 64, 128] and all(t > 0 for _, t in loaded.points)
    assert list(loaded.layer.values()) == [64, 96, 4, 2]
    assert FitCost.from_file(out) == FitCost(loaded.a, loaded.b)
    # A shrunk layer must not land in configs/cost_fit/ under the preset's name.
    with pytest.raises(SystemExit):
        script.main(tiny)
    assert "a changed layer shape needs --out" in capsys.readouterr().err


def plan_rows(capsys, *args) -> list[dict]:
    plan_main(["--ranks", "2", "--minibatch-sizes", "8", "--draws", "1", "--json", "--cost", "fit", *args])
    return json.loads(capsys.readouterr().out)["rows"]


def test_odc_plan_reads_a_fit_file(tmp_path, capsys):
    path = tmp_path / "fit.json"
    calibration().save(path)
    # Per-layer seconds times Qwen2.5-1.5B's 28 layers: the same as giving the whole model's coefficients.
    from_file = plan_rows(capsys, "--fit-file", str(path))
    assert from_file == plan_rows(capsys, "--fit-a", repr(2e-11 * 28), "--fit-b", repr(3e-7 * 28))
    half = plan_rows(capsys, "--fit-file", str(path), "--num-layers", "14")
    assert half[0]["seconds"] == pytest.approx({k: v / 2 for k, v in from_file[0]["seconds"].items()})

    calibration(model="my-model").save(tmp_path / "mine.json")
    for args, message in [
        (["--fit-file", str(path), "--fit-a", "1"], "--cost fit takes --fit-file or --fit-a and --fit-b, not both"),
        ([], "--cost fit needs --fit-file, or --fit-a and --fit-b"),
        (["--fit-file", str(tmp_path / "mine.json")], "model 'my-model' is not a preset; give --num-layers"),
        (["--fit-file", str(tmp_path / "none.json")], "cannot be read"),
    ]:
        with pytest.raises(SystemExit):
            plan_rows(capsys, *args)
        assert message in capsys.readouterr().err
