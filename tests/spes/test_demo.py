"""odc-spes at test size: three modes on real node processes, the report's numbers against the formulas."""

from __future__ import annotations

import json
import math

import pytest

from odc_plugin.spes import MODES
from odc_plugin.spes.demo import SPESDemoConfig, main, run_demo
from odc_plugin.spes.sync import allreduce_bytes


def test_tiny_run_reports_every_mode(tmp_path, capsys):
    cfg = SPESDemoConfig(
        nodes=2,
        steps=4,
        sync_every=2,
        model_size="test",
        batch_size=2,
        seq_len=32,
        heldout_sequences=8,
        out_dir=str(tmp_path),
    )
    returned = run_demo(cfg)
    with open(tmp_path / "odc_spes.json") as f:
        report = json.load(f)
    assert report == json.loads(json.dumps(returned))
    assert (tmp_path / "odc_spes.png").stat().st_size > 0
    modes = report["modes"]
    shared, experts = 4 * report["model"]["shared_parameters"], 4 * report["model"]["expert_parameters"]
    full = shared + experts
    for mode in MODES:
        r = modes[mode]
        assert [s for s, _ in r["heldout_loss"]] == [0, 2, 4]
        assert all(math.isfinite(loss) for _, loss in r["heldout_loss"])
        assert r["tokens"] == 4 * 2 * 2 * 32
        for state in r["trainable_state_bytes_per_node"]:
            assert 0 <= state["measured"] - state["counted"] < 0.01 * state["counted"]  # Adam's step counters
    # every mode starts from the same weights
    assert len({modes[m]["heldout_loss"][0][1] for m in MODES}) == 1
    # trainable state: the shared parameters and half the experts, x4 (param, grad, two moments)
    for state in modes["spes"]["trainable_state_bytes_per_node"]:
        assert state["counted"] == 4 * (shared + experts // 2) and state["frozen"] == experts // 2
    assert modes["spes"]["state_fraction_of_full"] == pytest.approx((shared + experts / 2) / full)
    # bytes per node: a ring all-reduce moves (N - 1) / N of the buffer twice; experts go owner to peer
    assert modes["spes"]["bytes_per_sync_per_node"] == [[allreduce_bytes(shared, 2) + experts // 2] * 2] * 2
    assert modes["fedavg"]["bytes_per_sync_per_node"] == [[allreduce_bytes(full, 2)] * 2] * 2
    assert modes["centralized"]["bytes_per_step_per_node"] == [[allreduce_bytes(full, 2)] * 2] * 2
    assert modes["spes"]["total_bytes_per_node"][0] == [2 * (shared + experts // 2)] * 2
    assert modes["centralized"]["total_bytes_per_node"][0] == [4 * full] * 2
    assert report["spes_over_fedavg_bytes_per_sync"] == pytest.approx((shared + experts / 2) / full)
    out = capsys.readouterr().out  # the table is printed by the parent
    assert "SPES - centralized final held-out loss" in out and "bytes per sync per node" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nodes", "3"], "--nodes 3: num_experts (8) must be divisible by the number of nodes (3)"),
        (["--nodes", "0"], "--nodes must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--steps", "25"], "--steps must be a positive multiple of the sync period 10, got 25"),
        (["--outer-lr", "-1"], "--outer-lr must be > 0, got -1.0"),
        (["--outer-momentum", "1"], "--outer-momentum must be in [0, 1), got 1.0"),
        (["--outer-optimizer", "adam"], "argument --outer-optimizer: invalid choice: 'adam'"),
    ],
)
def test_bad_options_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err
