"""Step-time model and the odc-plan command."""

from __future__ import annotations

import json

import pytest

from odc_plugin.balance import get_cost_model, rl_math_like
from odc_plugin.balance.planner import StepTimeModel, compare_schemes, main, simulate_minibatch


def test_lockstep_pays_the_slowest_rank_per_micro_batch():
    # Two ranks, two micro-batches each; each rank's total is 5, but each step has a 4.
    plan, costs = [[[0], [1]], [[2], [3]]], [4, 1, 1, 4]
    fsdp = simulate_minibatch(plan, costs, lockstep=True)
    odc = simulate_minibatch(plan, costs, lockstep=False)
    assert (fsdp.seconds, fsdp.idle_fraction) == (8, 1 - 10 / 16)
    assert (odc.seconds, odc.idle_fraction) == (5, 0)
    assert simulate_minibatch([[], []], [], lockstep=False).seconds == 0


def test_communication_bounds_short_micro_batches():
    # 4 layers x 100 bytes, 1/2 of it remote, at 10 bytes/s inside the node: 20 s per micro-batch.
    model = StepTimeModel(throughput=2.0, layer_comm_bytes=100, num_layers=4, intra_node_bw=10, gpus_per_node=8)
    assert model.comm_seconds(2) == 20
    assert simulate_minibatch([[[0], [1]], [[2]]], [100, 10, 10], lockstep=False, model=model).seconds == 70
    assert StepTimeModel(layer_comm_bytes=100, num_layers=4, inter_node_bw=5).comm_seconds(16) == 75


def test_bad_models_and_plans():
    with pytest.raises(ValueError, match="throughput must be > 0"):
        StepTimeModel(throughput=0)
    with pytest.raises(ValueError, match="layer_comm_bytes needs num_layers"):
        StepTimeModel(layer_comm_bytes=1)
    with pytest.raises(ValueError, match=r"lockstep ranks need equal micro-batch counts, got counts \[1, 2\]"):
        simulate_minibatch([[[0]], [[1], [2]]], [1, 1, 1], lockstep=True)


@pytest.mark.parametrize("cost", ["tokens", "flops"])
def test_odc_never_slower_on_rl_like_draws(cost):
    for seed in range(10):
        lens = rl_math_like(64, seed=seed).total
        times = compare_schemes(lens, 16, 8192, get_cost_model(cost)).times
        fsdp, odc_micro, odc_mini = (times[s].seconds for s in ("fsdp_lb_micro", "odc_lb_micro", "odc_lb_mini"))
        assert odc_mini <= odc_micro <= fsdp


def test_cli_table_json_and_plot(tmp_path, capsys):
    args = ["--ranks", "2", "4", "--minibatch-sizes", "8", "10", "--draws", "2", "--cost", "tokens"]
    main([*args, "--plot", str(tmp_path / "plan.png")])
    table = capsys.readouterr().out
    assert "FSDP+LB-Micro" in table and "ODC+LB-Mini" in table
    assert (tmp_path / "plan.png").stat().st_size > 0
    main([*args, "--json"])
    out = json.loads(capsys.readouterr().out)
    # 10 samples do not divide over 4 ranks: that row is left out, as verl could not run it.
    assert [(r["dp_size"], r["minibatch_size"]) for r in out["rows"]] == [(2, 8), (2, 10), (4, 8)]
    assert all(r["speedup"]["odc_lb_mini"] >= 1 for r in out["rows"])


def test_cli_lengths_file_and_errors(tmp_path, capsys):
    (tmp_path / "l.txt").write_text("\n".join(str(n) for n in range(100, 2000, 37)))
    main(["--lengths", str(tmp_path / "l.txt"), "--ranks", "4", "--minibatch-sizes", "16", "--draws", "1", "--json"])
    assert json.loads(capsys.readouterr().out)["max_token_len"] == 16384
    for argv, message in [
        (["--cost", "fit"], "--cost fit needs --fit-file, or --fit-a and --fit-b"),
        (["--lengths", str(tmp_path / "none.txt")], "not found"),
        (["--ranks", "3", "--minibatch-sizes", "8"], "no mini-batch size divides evenly"),
        (["--max-token-len", "100"], "more than max_token_len=100"),
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
