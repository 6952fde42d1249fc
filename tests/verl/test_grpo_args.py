"""odc-grpo-cpu refuses bad options and overrides of the keys it sets itself in one line, before anything
starts or is written; odc engine options go to the runs of strategy odc only."""

from __future__ import annotations

import pytest

from odc_plugin.verl.cpu import grpo, grpo_config

FIT = "configs/cost_fit/Qwen2.5-7B-H100.json"


def _refused(capsys, tmp_path, argv) -> str:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        grpo.main(["--out", str(out), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert not out.exists()  # nothing was created
    return err[-1]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--timeout-s", "0"], "argument --timeout-s: must be a finite number > 0, got '0'"),
        (["--timeout-s", "nan"], "argument --timeout-s: must be a finite number > 0, got 'nan'"),
        (["--emulate", FIT, "--time-scale", "0"], "argument --time-scale: must be a finite number > 0 or 'auto'"),
        (["--emulate", FIT, "--time-scale", "inf"], "argument --time-scale: must be a finite number > 0 or 'auto'"),
        (["--rollout-fit", FIT], "--rollout-fit needs --emulate"),
        (["--rollout-servers", "2"], "--rollout-servers needs --emulate"),
        (["--emulate", FIT, "--rollout-servers", "0"], "--rollout-servers must be an integer >= 1, got 0"),
        (["--emulate", FIT, "--rollout-fit", FIT], f"{FIT}: not a decode fit file"),
        (["--slow-ranks", "1:inf"], "--slow-ranks: factor of rank 1 must be a finite number > 0, got inf"),
        (["actor_rollout_ref.actor.strategy=fsdp2"], "sets actor_rollout_ref.actor.strategy itself: use --compare"),
        (["trainer.total_training_steps=7"], "sets trainer.total_training_steps itself: use --steps"),
        (["trainer.logger=[console]"], "sets trainer.logger itself: leave it out"),
        (["+critic.fsdp.odc_lockstep=True"], "sets critic.fsdp.odc_lockstep itself: use --compare"),
        (
            ["--compare", "fsdp2", "actor_rollout_ref.actor.fsdp_config.odc_transport=shm"],
            "is an odc engine option, but no run of --compare fsdp2 is odc",
        ),
    ],
)
def test_bad_options_and_harness_keys_are_refused_in_one_line(tmp_path, capsys, argv, message):
    assert message in _refused(capsys, tmp_path, argv)


def test_an_output_path_that_is_a_file_is_refused(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    with pytest.raises(SystemExit):
        grpo.main(["--out", str(afile)])
    assert "--out" in capsys.readouterr().err.strip().splitlines()[-1]
    assert afile.read_text() == "keep"


def test_odc_engine_options_go_to_the_odc_runs_only(tmp_path):
    option = "actor_rollout_ref.actor.fsdp_config.odc_transport=shm"
    other = "actor_rollout_ref.actor.use_kl_loss=True"
    fsdp2 = grpo.run_args([], "fsdp2", [option, other], str(tmp_path / "m.jsonl"))
    odc = grpo.run_args([], "odc", [option, other], str(tmp_path / "m.jsonl"))
    assert option not in fsdp2 and other in fsdp2
    # the odc run gets the plugin's configs on the search path, before the option, once
    assert odc.index(grpo_config.ODC_OPTIONS[1]) < odc.index(option) and other in odc
    lockstep = grpo.run_args([], "lockstep", [option], str(tmp_path / "m.jsonl"))
    assert lockstep.count(grpo_config.ODC_OPTIONS[0]) == 1 and option in lockstep


def test_help_shows_the_timeout_default(capsys):
    with pytest.raises(SystemExit):
        grpo.main(["--help"])
    assert "(default 1800)" in " ".join(capsys.readouterr().out.split())
