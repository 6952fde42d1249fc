"""odc-demo at tiny size: the four rows, really trained by 2 CPU ranks."""

from __future__ import annotations

import json

import pytest

from odc_plugin.demo import main
from odc_plugin.demo.config import SAMPLES_PER_RANK, DemoConfig
from odc_plugin.demo.rows import FACTORS, ROWS, SPLIT_ROW
from odc_plugin.demo.run import run_demo
from odc_plugin.demo.workload import draw_minibatches
from odc_plugin.models import MODEL_SIZES


def test_tiny_demo_reports_four_rows_that_train_the_same_samples_to_the_same_parameters(tmp_path, capfd):
    cfg = DemoConfig(
        ranks=2,
        steps=2,
        model_size="tiny",
        mini_batch_size=2,
        max_response_length=256,
        max_token_len=512,
        out_dir=str(tmp_path),
    )
    report = run_demo(cfg)
    with open(tmp_path / "odc_demo.json") as f:
        assert json.load(f) == json.loads(json.dumps(report))
    assert (tmp_path / "odc_demo.png").stat().st_size > 0
    assert list(report["runs"]) == list(ROWS)
    batches = draw_minibatches(cfg)
    for row, r in report["runs"].items():
        assert len(r["step_s"]) == 2 and r["median_step_s"] > 0 and r["tokens_per_s"] > 0
        assert len(r["predicted_step_s"]) == 2 and all(t > 0 for t in r["predicted_step_s"])
        for k, batch in enumerate(batches):
            # every sample of the mini-batch trained exactly once, by some rank
            trained = sorted(seed for rank in r["samples_per_rank"][k] for seed in rank)
            assert trained == sorted(s.seed for s in batch), row
            # the parts of each rank's mini-batch add up to the mini-batch's time
            for part in r["breakdown"][k]:
                assert all(part[p] >= 0 for p in ("comm_s", "wait_s")), (row, part)
                assert sum(part.values()) == pytest.approx(r["step_s"][k])
        for rank in range(2):
            fractions = [r["fraction_per_rank"][p][rank] for p in ("compute", "comm", "wait")]
            assert sum(fractions) == pytest.approx(1) and fractions[0] > 0
        if row.endswith("lb_micro"):  # LB-Micro: every rank runs the same number of micro-batches
            assert all(len(set(counts)) == 1 for counts in r["micro_batches_per_rank"])
    # the lockstep row meets at every gather and scatter of every layer, ODC rows once per mini-batch
    layers = MODEL_SIZES["tiny"].num_hidden_layers
    lockstep = report["runs"]["lockstep+lb_micro"]
    for k in range(2):
        for rank in range(2):
            assert lockstep["barriers_per_rank"][k][rank] > 2 * layers * lockstep["micro_batches_per_rank"][k][rank]
    for row in ("odc+lb_micro", "odc+lb_mini"):
        assert report["runs"][row]["barriers_per_rank"] == [[1, 1], [1, 1]]
    assert report["runs"]["fsdp2+lb_micro"]["barriers_per_rank"] == [[0, 0], [0, 0]]
    rows_not_run = {"auto", "lb_mini_auto", "split"}
    assert set(report["factors"]) == set(report["predicted_factors"]) == set(FACTORS) - rows_not_run
    assert report["predicted_factors"]["transport"] == 1.0  # the planner has no transport in it
    assert report["max_param_diff"] < 1e-5
    # fp32 gathers: the published shards, 4 bytes per parameter, and the accumulator's padding (its
    # gradients are the `.grad` FSDP2 would hold)
    assert 4 <= report["extra_bytes_per_param"] < 4.1, report["extra_bytes_per_param"]
    out = capfd.readouterr().out  # the progress lines come from rank 0's process
    assert "ODC+LB-Mini over the lockstep baseline on the same transport" in out and "mini-batch 2/2" in out
    assert "nothing can be balanced" not in out  # 8 samples over 2 ranks
    assert "ODC's memory over FSDP2: " in out


def test_the_split_row_splits_long_samples_over_ranks_and_trains_to_the_same_parameters(tmp_path, capfd):
    """One long-tailed SFT sample per rank: the split row runs the longest over Ulysses groups of 2 or 4 of
    the 4 ranks (the small model's 4 heads), the rest whole, and ends where every other row does."""
    cfg = DemoConfig(
        ranks=4, steps=2, workload="sft", mini_batch_size=4, max_token_len=512, split=True, out_dir=str(tmp_path)
    )
    report = run_demo(cfg)
    assert list(report["runs"]) == [*ROWS, SPLIT_ROW]
    split = report["runs"][SPLIT_ROW]
    assert sum(split["splits_per_minibatch"]) > 0, split["splits_per_minibatch"]
    for k, batch in enumerate(draw_minibatches(cfg)):
        trained = sorted(seed for rank in split["samples_per_rank"][k] for seed in rank)
        assert trained == sorted(s.seed for s in batch)  # a split sample counts once, for its first member
    assert report["max_param_diff"] < 1e-5
    assert {lim["bound"] for lim in report["split_limit"]} <= {"work", "sample"}
    assert "split" in report["factors"] and "split" in report["predicted_factors"]
    assert "limit with splitting: " in capfd.readouterr().out


def test_the_default_mini_batch_gives_every_rank_several_samples():
    for ranks in (1, 2, 16):
        for workload in ("rl", "sft"):
            cfg = DemoConfig(ranks=ranks, workload=workload)
            assert cfg.samples_per_minibatch == SAMPLES_PER_RANK * ranks == len(draw_minibatches(cfg)[0])


def test_a_run_with_one_sample_per_rank_says_nothing_can_be_balanced(tmp_path, capsys):
    main(
        [
            "--ranks",
            "2",
            "--workload",
            "sft",
            "--mini-batch-size",
            "2",
            "--steps",
            "1",
            "--model-size",
            "tiny",
            "--max-token-len",
            "256",
            "--out-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out.splitlines()
    limit = next(line for line in out if line.startswith("limit: "))
    assert "the larger of its work over the ranks' summed speeds and its longest sample on the fastest rank" in limit
    note = out[out.index(limit) + 1 :]
    assert any(
        line.startswith("NOTE: each mini-batch (2 samples, 2 ranks): at most one sample per rank, so nothing can be")
        for line in note
    )


def test_sft_workload_is_long_tailed_and_trains_response_likelihood():
    cfg = DemoConfig(ranks=2, steps=2, workload="sft", max_token_len=4096)
    for batch in draw_minibatches(cfg):
        totals = sorted(s.total for s in batch)
        assert len(batch) == 16 and totals[-1] <= 4096 and totals[-1] > 8 * totals[len(totals) // 2]
        assert {s.advantage for s in batch} == {1.0}


def test_lengths_file_drives_the_mini_batches(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([40, 300, 120, 900, 64]))
    cfg = DemoConfig(ranks=2, steps=1, mini_batch_size=4, lengths=str(lengths), out_dir=str(tmp_path))
    (batch,) = draw_minibatches(cfg)
    assert {s.total for s in batch} <= {40, 300, 120, 900, 64} and len(batch) == 16


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ranks", "0"], "--ranks must be >= 1"),
        (["--model-size", "huge"], "invalid choice: 'huge'"),
        (["--lengths", "/nonexistent"], "--lengths: length file '/nonexistent' not found"),
        (["--max-token-len", "100"], "--max-token-len 100 is below the longest possible sample"),
        (["--workload", "pretrain"], "invalid choice: 'pretrain'"),
        (["--mini-batch-size", "0"], "--mini-batch-size must be >= 1"),
        (["--split", "--model-size", "tiny"], "--split: the attention heads of tiny divide over no group of 2 or more"),
    ],
)
def test_bad_options_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err
