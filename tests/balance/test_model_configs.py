"""The `flops` cost from a model's config.json: verl's FlopsCounter for every architecture it knows (a dense,
a sliding-window and a mixture-of-experts model, tiny ones written here), odc_plugin's own formula for one
it does not; and `odc-plan --model MODEL_DIR` planning with it."""

from __future__ import annotations

import json

import pytest

from odc_plugin.balance.costs import FlopsCost, VerlFlopsCost, flops_cost
from odc_plugin.balance.planner import main
from tests.verl import harness as H

from .verl_ranks import flops_counter_on_rank

SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}
LENGTHS = [40, 100, 300, 1000]  # beyond the sliding window of 64 tokens from the third on
PLAN_LENGTH = 3000  # odc-plan's mini-batch: 4 of these


def _configs():
    from transformers import Gemma3TextConfig, Qwen2Config, Qwen3MoeConfig

    return {
        "dense": Qwen2Config(**SHAPE, intermediate_size=96),
        "sliding_window": Gemma3TextConfig(
            **SHAPE,
            intermediate_size=96,
            head_dim=16,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "moe": Qwen3MoeConfig(
            **SHAPE, intermediate_size=96, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2
        ),
    }


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name, config in _configs().items():
        dirs[name] = str(tmp_path_factory.mktemp(name))
        config.save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def verl_flops(model_dirs):
    """verl's FlopsCounter.estimate_flops on each config: (LENGTHS, odc-plan's mini-batch)."""
    (counts,) = H.run_on_ranks(flops_counter_on_rank, 1, list(model_dirs.values()), [LENGTHS, [PLAN_LENGTH] * 4])
    return dict(zip(model_dirs, counts))


@pytest.mark.parametrize("name", ["dense", "sliding_window", "moe"])
def test_flops_cost_of_a_config_json_is_verls_flops_counter(name, model_dirs, verl_flops):
    cost = flops_cost(model_dirs[name])
    assert isinstance(cost, VerlFlopsCost) and cost.num_hidden_layers == 4
    assert sum(cost.costs(LENGTHS)) == pytest.approx(verl_flops[name][0], rel=1e-12)
    own = FlopsCost.from_config(cost.config)
    if name == "sliding_window":  # the own formula attends over the whole sequence in every layer
        assert own(1000) > 1.4 * cost(1000)
    else:
        assert own.costs(LENGTHS) == pytest.approx(cost.costs(LENGTHS), rel=1e-12)


@pytest.mark.parametrize("name", ["dense", "sliding_window", "moe"])
def test_odc_plan_model_dir_costs_as_verls_flops_counter(name, model_dirs, verl_flops, tmp_path, capsys):
    """One rank, one mini-batch of four 3000-token sequences, one cost unit per second: the planner's time
    is the mini-batch's FLOPs, which verl's FlopsCounter counts for the same lengths."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text(f"{PLAN_LENGTH}\n")
    args = ["--model", model_dirs[name], "--lengths", str(lengths), "--ranks", "1", "--minibatch-sizes", "4"]
    main([*args, "--throughput", "1", "--draws", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["cost_model"].startswith(f"flops (verl's FlopsCounter, model_type {_configs()[name].model_type}")
    (row,) = out["rows"]
    for seconds in row["seconds"].values():
        assert seconds == pytest.approx(verl_flops[name][1], rel=1e-12)
    main(args + ["--draws", "1"])
    assert f"model_type {_configs()[name].model_type}" in capsys.readouterr().out


def test_an_architecture_verl_does_not_know_gets_the_own_formula(tmp_path, capsys):
    config = {"model_type": "not_in_verl", **SHAPE, "intermediate_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cost = flops_cost(str(tmp_path))
    assert cost == FlopsCost.from_config(config)
    main(["--model", str(tmp_path), "--ranks", "2", "--minibatch-sizes", "4", "--draws", "1"])
    assert f"own formula: verl's FlopsCounter does not know {tmp_path}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "nowhere")])
    assert "is neither a preset (Qwen2.5-0.5B, " in capsys.readouterr().err
