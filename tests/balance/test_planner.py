"""Step-time model and the odc-plan command."""

from __future__ import annotations

import json

import pytest

from odc_plugin.balance import get_cost_model, rl_math_like
from odc_plugin.balance.lengths import plan_lengths
from odc_plugin.balance.planner import main
from odc_plugin.balance.step_time import (
    ClusterModel,
    StepTimeModel,
    compare_schemes,
    model_params,
    plan_table,
    simulate_minibatch,
)


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
    with pytest.raises(ValueError, match="throughput must be finite and > 0"):
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


def test_cluster_model_communication():
    # 1e9 parameters, 8 bytes moved per parameter per micro-batch (bf16 gathered twice, fp32 gradient),
    # 2 nodes of 8 GPUs, 1e11 B/s inside a node and 1e10 across
    cluster = ClusterModel(1e9, gpus_per_node=8, intra_node_bw=1e11, inter_node_bw=1e10)
    assert cluster.micro_batch_comm("odc_hsdp", 2) == pytest.approx(8e9 * 7 / 8 / 1e11)
    # ring all-reduce of the 4e9 / 8 byte gradient shard over 2 nodes: 2 * 1/2 * 5e8 / 1e10
    assert cluster.all_reduce_seconds(2) == pytest.approx(0.05)
    assert cluster.end_seconds("odc_hsdp", 2) == cluster.all_reduce_seconds(2)
    assert cluster.end_seconds("fsdp_hsdp", 2) == cluster.end_seconds("odc_flat", 2) == 0
    assert cluster.micro_batch_comm("fsdp_hsdp", 2) == pytest.approx(max(0.07, 0.05))
    # flat over 16 ranks: 8 of the 16 shards are on the other node
    assert cluster.micro_batch_comm("odc_flat", 2) == pytest.approx(8e9 * 8 / 16 / 1e10)
    with pytest.raises(ValueError, match="ClusterModel.inter_node_bw must be finite and > 0"):
        ClusterModel(1e9, inter_node_bw=0)


def test_model_params_of_the_presets():
    assert model_params("Qwen2.5-7B") == pytest.approx(7.62e9, rel=1e-3)  # untied head
    assert model_params("Qwen2.5-0.5B") == pytest.approx(0.494e9, rel=1e-3)  # tied


@pytest.mark.parametrize(
    "nodes,inter_node_bw,fastest,pick",
    [(2, 1e12, "odc_flat", "odc_hsdp"), (2, 1e10, "odc_hsdp", "odc_hsdp"), (4, 1e9, "fsdp_hsdp", "fsdp_hsdp")],
)
def test_cli_nodes_picks_by_network(nodes, inter_node_bw, fastest, pick, capsys):
    """SFT lengths: a network as fast as NVLink hides flat ODC's traffic and saves the all-reduce, but flat
    ODC is refused by this version, so the pick is the fastest of what runs; at 10 GB/s flat ODC's traffic
    outweighs the one all-reduce of ODC-HSDP, whose balance pays for it; over a slower one the all-reduce,
    which FSDP overlaps with every micro-batch's compute, costs ODC more than FSDP's imbalance."""
    args = [
        "--nodes",
        str(nodes),
        "--lengths",
        "sft",
        "--minibatch-sizes",
        "128",
        "--draws",
        "2",
        "--inter-node-bw",
        str(inter_node_bw),
    ]
    main([*args, "--json"])
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["pick"] == pick, row
    assert all(row["seconds"][fastest] < t for s, t in row["seconds"].items() if s != fastest), row
    main(args)
    out = capsys.readouterr().out
    assert "flat ODC+LB-Mini" in out and "refused by this version, so it is shown, never picked" in out
    with pytest.raises(SystemExit):
        main(["--nodes", "1"])
    assert "--nodes compares multi-node set-ups; got 1 node(s)" in capsys.readouterr().err


def test_ulysses_groups_are_the_units_of_lockstep_and_balance(capsys):
    """--sp N: ranks / N groups, each N times as fast and packing N times the per-GPU budget: the same
    prediction as that many single ranks so scaled (the all-to-all is not modelled)."""
    draw = plan_lengths("rl", max_response_length=16384).draw
    cost, model = get_cost_model("flops"), StepTimeModel(throughput=4e14)
    (row,) = plan_table(draw, [8], [32], 16896, cost, model, draws=2, sp_sizes=[2])
    (groups,) = plan_table(draw, [4], [32], 2 * 16896, cost, StepTimeModel(throughput=8e14), draws=2)
    assert (row.dp_size, row.sp) == (4, 2) and row.seconds == groups.seconds
    main(["--sp", "1", "2", "4", "--ranks", "8", "--minibatch-sizes", "32", "--draws", "1", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["sp"], r["dp_size"]) for r in rows] == [(1, 8), (2, 4), (4, 2)]
    with pytest.raises(SystemExit):
        main(["--sp", "0"])
    assert "argument --sp: must be an integer > 0, got '0'" in capsys.readouterr().err


def test_cli_plans_a_runs_steps_with_fixed_micro_batches(tmp_path, monkeypatch, capsys):
    """A run's metrics file (verl's file logger): by default one mini-batch per row of a whole step, one draw
    per step; with --micro-batch-size, verl's fixed micro-batches (rows whose per-rank share they do not
    divide are left out, as verl refuses them)."""
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "run.jsonl"))
    logger = FileLogger("odc", "plan")
    for step, mean in ((1, 800.0), (2, 1500.0)):
        stats = {"mean": mean, "max": 4096.0, "min": 20.0, "clip_ratio": 0.05}
        data = {f"response_length/{k}": v for k, v in stats.items()}
        data |= {"prompt_length/mean": 200.0, "prompt_length/max": 400.0, "prompt_length/min": 60.0}
        logger.log(data | {"perf/total_num_tokens": 64 * (200.0 + mean), "timing_s/step": 1.0}, step)
    logger.finish()
    capsys.readouterr()  # the logger's own line
    main(["--lengths", str(tmp_path / "run.jsonl"), "--ranks", "4", "8", "--micro-batch-size", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert "2 steps of" in out["lengths_from"] and out["micro_batch_size"] == 4
    # 64 samples a step: 16 per rank at 4 ranks; 8 per rank at 8 ranks; both divide into micro-batches of 4
    assert [(r["dp_size"], r["minibatch_size"]) for r in out["rows"]] == [(4, 64), (8, 64)]
    for r in out["rows"]:
        assert r["seconds"]["odc_lb_mini"] <= r["seconds"]["odc_lb_micro"] < r["seconds"]["fsdp_lb_micro"]
    with pytest.raises(SystemExit):
        main(["--lengths", str(tmp_path / "run.jsonl"), "--ranks", "4", "--micro-batch-size", "3"])
    assert "no mini-batch size divides evenly over any rank count into micro-batches of 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nodes", "3", "--minibatch-sizes", "256"], "no mini-batch size divides evenly over any node count's GPUs"),
        (["--nodes", "2", "--gpus-per-node", "3"], "no mini-batch size divides evenly over any node count's GPUs"),
        (["--ranks", "0"], "argument --ranks: must be an integer > 0, got '0'"),
        (["--throughput", "inf"], "argument --throughput: must be a finite number > 0, got 'inf'"),
        (["--throughput", "nan"], "argument --throughput: must be a finite number > 0, got 'nan'"),
        (["--throughput", "0"], "argument --throughput: must be a finite number > 0, got '0'"),
        (["--max-token-len", "0"], "argument --max-token-len: must be an integer > 0, got '0'"),
        (["--cost", "fit", "--fit-file", "FIT", "--num-layers", "0"], "argument --num-layers: must be an integer > 0"),
        (["--cost", "fit", "--fit-file", "FIT", "--num-layers", "-2"], "argument --num-layers: must be an integer > 0"),
        (["--nodes", "2", "--model-params", "0"], "argument --model-params: must be a finite number > 0, got '0'"),
        (["--cost", "fit", "--fit-a", "nan", "--fit-b", "1"], "argument --fit-a: must be a finite number >= 0"),
        (["--layer-comm-bytes", "nan"], "argument --layer-comm-bytes: must be a finite number >= 0, got 'nan'"),
        (["--max-response-length", "0"], "argument --max-response-length: must be an integer > 0, got '0'"),
        (["--max-response-length", "-1"], "argument --max-response-length: must be an integer > 0, got '-1'"),
        (["--max-prompt-length", "-200"], "argument --max-prompt-length: must be an integer > 0, got '-200'"),
        (["--draws", "1.5"], "argument --draws: must be an integer > 0, got '1.5'"),
        (["--plot", "/nonexistent-dir/x.png"], "--plot /nonexistent-dir/x.png: no directory /nonexistent-dir"),
        (["--nodes", "2", "--ranks", "8", "--sp", "2"], "--ranks, --sp: not used with --nodes"),
        (["--cost", "tokens", "--fit-file", "FIT"], "--fit-file: for --cost fit, not --cost tokens"),
        (
            ["--cost", "tokens", "--model", "Qwen2.5-7B"],
            "--model is for --cost flops (or --nodes without --model-params)",
        ),
        (["--model-params", "1e9"], "--model-params is for --nodes; drop it or give --nodes"),
        (["--nodes", "2", "--fsdp-shares", "sampler"], "--fsdp-shares: not used with --nodes"),
        (["--nodes", "2", "--trainer-mode", "sync"], "--trainer-mode: not used with --nodes"),
        (["--rollout-fit", "FIT"], "--rollout-fit is for a modelled --trainer-mode"),
        (["--trainer-mode", "sync", "--json"], "--trainer-mode prints its end-to-end lines as text"),
        (["--trainer-mode", "sync", "--rollout-fit", "FIT"], "FIT: not a decode fit file"),
        (["--trainer-mode", "sync", "--model", "Qwen3-8B"], "a modelled --trainer-mode needs --rollout-fit"),
    ],
)
def test_cli_refuses_bad_numbers_and_unused_options_in_one_line(argv, message, capsys):
    """Bad input: one error line naming the option, a nonzero exit and nothing on stdout; 0 never stands
    for a default, and no option is silently ignored."""
    fit = "configs/cost_fit/Qwen2.5-7B-H100.json"
    argv, message = [a.replace("FIT", fit) for a in argv], message.replace("FIT", fit)
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--draws", "1"] if "--draws" not in argv else argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert message in err.splitlines()[-1] and "Traceback" not in err


def test_cli_names_the_baseline_and_the_rows_it_leaves_out(tmp_path, capsys):
    args = ["--ranks", "3", "4", "--minibatch-sizes", "8", "10", "--draws", "1", "--cost", "tokens"]
    main(args)
    out, err = capsys.readouterr()
    assert "speedup over FSDP+LB-Micro" in out.splitlines()[2]
    assert err.splitlines() == [
        "odc-plan: note: left out, as verl could not run them: "
        "ranks=3 mini-batch=8 (8 samples do not divide over 3 data-parallel ranks); "
        "ranks=3 mini-batch=10 (10 samples do not divide over 3 data-parallel ranks); "
        "ranks=4 mini-batch=10 (10 samples do not divide over 4 data-parallel ranks)"
    ]
    main([*args, "--json"])
    assert json.loads(capsys.readouterr().out)["speedup_baseline"] == "fsdp_lb_micro"
    (tmp_path / "zeros.json").write_text("[0, 0, 0]")
    with pytest.raises(SystemExit):
        main([*args, "--lengths", str(tmp_path / "zeros.json")])
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].endswith(
        "zeros.json: every length is 0, nothing to balance; give the file of the real lengths"
    )


def test_fsdp_with_its_samplers_shares_is_the_torchrun_sft_trainers_baseline(capsys):
    """Without rank balancing each rank trains its contiguous chunk of the (randomly ordered) mini-batch, as
    verl's torchrun SFT trainer's ranks train their samplers' shares: FSDP is slower, LB-Mini's plan the same."""
    from odc_plugin.balance.lb_micro import lb_micro

    lens = [100, 5000, 200, 300, 4000, 150, 250, 350]
    shares = lb_micro(lens, 2, 8192, micro_batch_size=2, balance_ranks=False)
    assert shares == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    args = ["--lengths", "sft", "--ranks", "8", "--minibatch-sizes", "64", "--draws", "2", "--cost", "tokens"]
    rows = {}
    for shares in ("balanced", "sampler"):
        main([*args, "--fsdp-shares", shares, "--json"])
        (rows[shares],) = json.loads(capsys.readouterr().out)["rows"]
    assert rows["sampler"]["seconds"]["fsdp_lb_micro"] > rows["balanced"]["seconds"]["fsdp_lb_micro"]
    assert rows["sampler"]["seconds"]["odc_lb_mini"] == pytest.approx(rows["balanced"]["seconds"]["odc_lb_mini"])


def test_cli_predicts_the_step_end_to_end_in_each_trainer_mode(tmp_path, monkeypatch, capsys):
    """Modelled: the rollout by the decode model (to its last response in sync, never running dry in the
    async modes), the passes by the planner; each mode's step as odc_plugin.balance.modes puts them together.
    From a run's metrics file: its own timing_s/*, the passes the planner's speedup faster."""
    import re

    from verl.utils.tracking import FileLogger

    main(
        ["--ranks", "16", "--minibatch-sizes", "1024", "--draws", "2", "--max-response-length", "16384"]
        + ["--trainer-mode", "sync", "colocate_async", "separate_async"]
    )
    out = capsys.readouterr().out.split("end to end (MODELLED):\n")[1]
    whole, steady, passes, x = map(
        float,
        re.search(
            r"rollout ([\d.]+) s to its last response, ([\d.]+) s never running dry; fsdp2's passes ([\d.]+) s, "
            r"odc's ([\d.]+)x faster",
            out,
        ).groups(),
    )
    expected = {"sync": (whole + passes, whole + passes / x), "colocate_async": (steady + passes, steady + passes / x)}
    expected["separate_async"] = (max(steady, passes), max(steady, passes / x))
    for mode, (base, odc) in expected.items():
        found = re.search(rf"  {mode}: step ([\d.]+) -> ([\d.]+) s", out).groups()
        assert [float(v) for v in found] == pytest.approx([base, odc], rel=2e-3), mode

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "run.jsonl"))
    logger = FileLogger("odc", "plan")
    for step in (1, 2):
        data = {"response_length/mean": 1500.0, "response_length/max": 8192.0, "response_length/min": 20.0}
        data |= {"response_length/clip_ratio": 0.0, "prompt_length/mean": 200.0, "prompt_length/max": 400.0}
        data |= {"prompt_length/min": 60.0, "perf/total_num_tokens": 64 * 1700.0}
        # 30 s waiting for the batch, 60 s of passes, 10 s of the rest
        timing = {"step": 100.0, "gen": 30.0, "old_log_prob": 10.0, "ref": 8.0, "update_actor": 42.0}
        logger.log(data | {f"timing_s/{k}": v for k, v in timing.items()}, step)
    logger.finish()
    capsys.readouterr()
    main(["--lengths", str(tmp_path / "run.jsonl"), "--ranks", "8", "--trainer-mode", "colocate_async"])
    line = capsys.readouterr().out.split("end to end (from the run's timings):\n")[1]
    x, e2e = map(float, re.search(r"the passes ([\d.]+)x \(the planner\), end to end ([\d.]+)x", line).groups())
    assert e2e == pytest.approx(100 / (30 + 60 / x + 10), abs=2e-3)
    with pytest.raises(SystemExit):
        main(["--lengths", str(tmp_path / "run.jsonl"), "--ranks", "8", "--trainer-mode", "sync", "separate_async"])
    assert "a run's timings are of the one mode it ran in" in capsys.readouterr().err


def test_cli_length_factor_plans_each_token_as_k(tmp_path, capsys):
    """An emulated rehearsal's run logs real tokens, each standing for K true ones: --length-factor K plans
    the true lengths (with the tokens cost, K times the seconds)."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (30, 5, 12, 60, 8, 9, 40, 3)) + "\n")
    args = ["--lengths", str(lengths), "--ranks", "2", "--minibatch-sizes", "8", "--draws", "2", "--cost", "tokens"]
    rows = {}
    for k in (1, 4):
        main([*args, "--length-factor", str(k), "--json"])
        out = json.loads(capsys.readouterr().out)
        rows[k] = out["rows"][0]["seconds"]
    assert "each token standing for 4" in out["lengths_from"]
    for scheme in ("fsdp_lb_micro", "odc_lb_mini"):  # compute only (the split adds all-to-alls in seconds)
        assert rows[4][scheme] == pytest.approx(4 * rows[1][scheme]), scheme
