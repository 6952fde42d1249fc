"""The A/B report on metric files written by verl's own `file` logger.

The synthetic runs go through the same verl code as a real training step: `compute_timing_metrics` and
`compute_throughout_metrics` name the timing and throughput metrics, `rename_dict` + `reduce_metrics`
turn the engines' per-mini-batch metrics into `actor/...` values, and `Tracking(default_backend="file")`
writes them. If verl changes a name or the file format, these tests fail.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.metric_utils import compute_throughout_metrics, compute_timing_metrics
from verl.utils.metric import reduce_metrics
from verl.utils.py_functional import rename_dict
from verl.utils.tracking import Tracking

from odc_plugin.verl import ab_report

N_GPUS = 8
PROMPT, RESPONSE, SEQS = 100, 400, 200  # tokens per step: 200 * 500 = 100,000
TOKENS = SEQS * (PROMPT + RESPONSE)


def _batch() -> DataProto:
    return DataProto.from_dict(
        tensors={
            "prompt_length": torch.full((SEQS,), float(PROMPT)),
            "response_length": torch.full((SEQS,), float(RESPONSE)),
        },
        meta_info={"global_token_num": [PROMPT + RESPONSE] * SEQS},
    )


def _engine_metrics(role: str, wait: float, compute: float) -> dict:
    """What an odc engine returns for two mini-batches, reduced the way verl's trainer does."""
    per_mini_batch = {
        "odc/compute_s_mean": [compute, compute],
        "odc/compute_s_max": [1.2 * compute, 1.1 * compute],
        "odc/wait_s_mean": [wait, wait],
        "odc/wait_s_max": [2 * wait, 3 * wait],
        "odc/compute_imbalance": [1.2, 1.1],
        "odc/micro_batches_min": [3, 2],
        "odc/micro_batches_max": [5, 6],
        "pg_loss": [np.float32(0.1), np.float32(0.2)],
    }
    return reduce_metrics(rename_dict(per_mini_batch, f"{role}/"))


def _agent_loop_timing(n: int = 4) -> dict:
    """What verl's agent loop adds to a step's timings (the legacy trainer logs them, `ray_trainer.py:1518`), from
    verl's own function: times, and counts, with num_preempted -1 where the rollout reports no preemptions
    (`single_turn_agent_loop.py:81-82`)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    metrics = [
        [{"generate_sequences": 0.5 + i, "tool_calls": 0.0, "compute_score": 0.01, "num_preempted": -1}]
        for i in range(n)
    ]
    output = DataProto.from_dict(
        tensors={"prompts": torch.ones(n, 3, dtype=torch.long), "attention_mask": torch.ones(n, 8, dtype=torch.long)}
    )
    return AgentLoopManager._performance_metrics(None, metrics, output)


def write_run(path, step_s, update_actor_s, *, odc=None, val=True, update_critic_s=None, agent_loop=False):
    """One run through verl's Tracking file logger; step 0 is a validation-only record like verl's
    `val_before_train`, and the last step also carries validation metrics; with `agent_loop` each step's timings
    also have the agent loop's, as the legacy trainer logs them."""
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        tracking = Tracking(project_name="odc_ab", experiment_name=path.stem, default_backend=["file"])
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]
    if val:
        tracking.log(data={"val-core/openai/gsm8k/acc/mean@1": 0.3}, step=0)
    batch = _batch()
    for i, (step, update) in enumerate(zip(step_s, update_actor_s), 1):
        timing_raw = {
            "gen": 0.5 * step,
            "old_log_prob": 0.05 * step,
            "ref": 0.05 * step,
            "adv": 0.01,
            "update_actor": update,
            "update_weights": 0.2,
            "step": step,
        }
        if update_critic_s is not None:
            timing_raw["update_critic"] = update_critic_s[i - 1]
        if agent_loop:
            timing_raw.update(_agent_loop_timing())
        metrics = {"training/global_step": i, "training/epoch": 0}
        metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing_raw))
        metrics.update(compute_throughout_metrics(batch=batch, timing_raw=timing_raw, n_gpus=N_GPUS))
        metrics.update(
            _engine_metrics("actor", **odc)
            if odc
            else reduce_metrics(rename_dict({"pg_loss": [np.float32(0.1)]}, "actor/"))
        )
        if i == len(step_s) and val:
            metrics["val-core/openai/gsm8k/acc/mean@1"] = 0.5
        tracking.log(data=metrics, step=i)
    tracking.finish()
    return path


@pytest.fixture
def runs(tmp_path):
    # first step: warm-up, left out by --skip-first 1
    write_run(tmp_path / "fsdp2.jsonl", [30, 10, 12, 10, 11, 10], [20, 4, 5, 4, 4, 4])
    write_run(tmp_path / "odc.jsonl", [30, 8, 9, 8, 8, 8], [20, 2, 2.5, 2, 2, 2], odc={"wait": 0.5, "compute": 1.5})
    return tmp_path


def test_files_are_verls_format(runs):
    lines = (runs / "odc.jsonl").read_text().splitlines()
    assert len(lines) == 7
    record = json.loads(lines[1])
    assert record["step"] == 1
    for key in (
        "timing_s/step",
        "timing_s/update_actor",
        "perf/total_num_tokens",
        "perf/throughput",
        "actor/odc/wait_s_mean",
        "actor/odc/compute_s_mean",
    ):
        assert key in record["data"], key


def test_medians_and_speedups(runs):
    base = ab_report.load_run(str(runs / "fsdp2.jsonl"))
    cand = ab_report.load_run(str(runs / "odc.jsonl"))
    assert list(base.steps) == [2, 3, 4, 5, 6]  # step 0 (validation only) and warm-up step 1 left out
    report = ab_report.compare(base, cand)
    rows = {r["key"]: r for r in report["rows"]}
    assert rows["update_s"]["baseline"] == 4 and rows["update_s"]["candidate"] == 2
    assert report["speedup_update"] == pytest.approx(2.0)
    assert rows["step_s"]["baseline"] == 10 and rows["step_s"]["candidate"] == 8
    assert report["speedup_end_to_end"] == pytest.approx(1.25)
    assert rows["update_tokens_per_s"]["baseline"] == pytest.approx(TOKENS / 4)
    assert rows["update_tokens_per_s"]["speedup"] == pytest.approx(2.0)
    assert rows["tokens_per_s_per_gpu"]["baseline"] == pytest.approx(TOKENS / (10 * N_GPUS))
    assert rows["tokens_per_s_per_gpu"]["speedup"] == pytest.approx(1.25)
    assert rows["tokens_per_s"]["candidate"] == pytest.approx(TOKENS / 8)
    assert rows["gen_s"]["speedup"] == pytest.approx(1.25)
    # the rollout is the same under both strategies: its ratio is printed as the runs' own difference
    assert report["control_rollout"] == pytest.approx(1.25)
    assert "control: the rollout, which the strategy does not touch, 1.25x" in ab_report.format_report(report)
    # a trainer without a rollout (verl's SFT trainers) has the runs' own steps as its control: fsdp2's 12 s / 10 s
    assert report["control_steps"] == pytest.approx(1.2)
    report["control_rollout"] = None
    assert "control: one run's own steps differ by up to 1.20x" in ab_report.format_report(report)
    # idle fraction from the odc engines' metrics only
    assert rows["actor_idle_fraction"]["baseline"] is None
    assert rows["actor_idle_fraction"]["candidate"] == pytest.approx(0.25)
    assert rows["actor_odc_wait_s_max"]["candidate"] == pytest.approx(1.5)
    assert rows["actor_odc_micro_batches_min"]["candidate"] == 2
    assert rows["actor_odc_micro_batches_max"]["candidate"] == 6
    assert "update_critic_s" not in rows and "critic_idle_fraction" not in rows


def test_text_report_from_a_run_directory(runs, capsys):
    assert ab_report.main([str(runs)]) == 0
    out = capsys.readouterr().out
    idle = next(line for line in out.splitlines() if line.startswith("actor idle fraction"))
    assert idle.split()[-2:] == ["n/a", "25.0%"]
    update = next(line for line in out.splitlines() if line.startswith("update phase s/step"))
    assert update.split()[-3:] == ["4", "2", "2.00x"]
    assert out.strip().splitlines()[-2] == "speedup odc over fsdp2: update phase 2.00x, end to end 1.25x"


def test_critic_counts_in_the_update_phase(tmp_path, capsys):
    base = write_run(tmp_path / "a.jsonl", [10, 10, 10], [4, 4, 4], update_critic_s=[2, 2, 2])
    cand = write_run(tmp_path / "b.jsonl", [9, 9, 9], [3, 3, 3], update_critic_s=[1, 1, 1], val=False)
    capsys.readouterr()  # verl's logger prints where it writes
    assert ab_report.main([str(base), str(cand), "--json", "--labels", "fsdp2", "odc", "--skip-first", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["candidate"]["label"] == "odc" and report["candidate"]["steps"] == 3
    rows = {r["key"]: r for r in report["rows"]}
    assert (rows["update_s"]["baseline"], rows["update_s"]["candidate"]) == (6, 4)
    assert report["speedup_update"] == pytest.approx(1.5)
    assert rows["update_critic_s"]["speedup"] == pytest.approx(2.0)


def test_unusable_inputs_fail_with_one_line(tmp_path, capsys):
    assert ab_report.main([str(tmp_path / "missing.jsonl"), str(tmp_path / "other.jsonl")]) == 1
    assert "no such metrics file" in capsys.readouterr().err
    only_val = write_run(tmp_path / "val.jsonl", [], [])
    write_run(tmp_path / "one.jsonl", [10], [4])
    assert ab_report.main([str(only_val), str(tmp_path / "one.jsonl")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "0 training step(s)" in err
    assert ab_report.main([str(tmp_path / "one.jsonl"), str(tmp_path / "one.jsonl")]) == 1
    assert "--skip-first=1" in capsys.readouterr().err


def test_counts_under_timing_s_are_not_read_as_times(tmp_path, capsys):
    """verl's legacy trainer logs its agent loop's counts under timing_s/ (timing_s/agent_loop/num_preempted/min=-1):
    the report reads only the times its figures divide by as times."""
    write_run(tmp_path / "fsdp2.jsonl", [30, 10, 12], [20, 4, 4], agent_loop=True)
    write_run(tmp_path / "odc.jsonl", [30, 8, 9], [20, 2, 2], agent_loop=True)
    logged = json.loads((tmp_path / "odc.jsonl").read_text().splitlines()[1])["data"]
    assert (
        logged["timing_s/agent_loop/num_preempted/min"] == -1 and "timing_s/agent_loop/slowest/prompt_length" in logged
    )
    capsys.readouterr()
    assert ab_report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "update phase s/step" in out and "num_preempted" not in out


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "bad: a directory, not a metrics file (verl's file logger, .jsonl)"),
        (b'{"step": 1, "data": [1, 2]}\n', "bad:1: not a verl file-logger record (data is a list, not an object"),
        (b"\xff\xfe\x00binary", "bad: not UTF-8 text (invalid start byte at byte 0), not a metrics file"),
        (b'{"step": 1, "data": {"timing_s/step": -5.0}}\n', "bad: step 1 logs timing_s/step=-5; a measured time"),
        (b'{"step": 2, "data": {"timing_s/step": 0.0}}\n', "bad: step 2 logs timing_s/step=0; a measured time"),
        (
            b'{"step": 1, "data": {"timing_s/step": 3.0, "timing_s/update_actor": -0.1}}\n',
            "bad: step 1 logs timing_s/update_actor=-0.1",
        ),
    ],
)
def test_unreadable_or_impossible_metrics_name_the_file_in_one_line(tmp_path, capsys, content, message):
    """A directory, a record whose data is not an object, a binary file, a time that cannot be measured: one
    line under the command's own name naming the file (and step), exit 1, nothing on stdout."""
    good = write_run(tmp_path / "good.jsonl", [10, 10], [4, 4])
    capsys.readouterr()  # verl's logger prints where it writes
    bad = tmp_path / "bad"
    if content is None:
        bad.mkdir()
    else:
        bad.write_bytes(content)
    assert ab_report.main([str(good), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("odc-ab-report: ") and message in err
    with pytest.raises(SystemExit):
        ab_report.main([str(good), str(bad), str(bad)])
    assert (
        capsys.readouterr().err.splitlines()[-1] == "odc-ab-report: error: give one run directory or two metric files"
    )


def test_phase_report_gives_each_phase_every_run_and_the_factors(tmp_path):
    """odc-grpo-cpu --compare fsdp2,lockstep,odc: per phase each run's s/step, and the factors between runs
    as medians of per-step ratios; with emulated runs' phase times, idle, the planner and its error."""
    from odc_plugin.verl.cpu.emulation import PhaseTime

    write_run(tmp_path / "fsdp2.jsonl", [30, 12, 12, 12], [20, 6, 6, 6], val=False)
    write_run(tmp_path / "lockstep.jsonl", [30, 11, 11, 11], [20, 5, 5, 5], val=False)
    write_run(tmp_path / "odc.jsonl", [30, 9, 9, 9], [20, 4, 4, 4], val=False)
    runs = [ab_report.load_run(str(tmp_path / f"{r}.jsonl"), r) for r in ("fsdp2", "lockstep", "odc")]
    # the planner: 4.5 s for both lockstep runs, 4 for odc; 6 rank-seconds of compute on 2 ranks; the
    # limit 3.2 s; 3 samples in the step's one pass
    times = {
        label: {"update_actor": [PhaseTime(4.0 if label == "odc" else 4.5, 6.0, 2, 3.2, 3)] * 4}
        for label in ("fsdp2", "lockstep", "odc")
    }
    text = ab_report.phase_report(runs, times, memory_gib={"odc": 6.5}, emulated="EMULATED layer compute")
    lines = text.splitlines()
    assert lines[0] == "per phase, medians over steps 2-4; EMULATED layer compute"
    update = lines.index(next(line for line in lines if line.startswith("update_actor")))
    assert lines[update].split() == ["update_actor", "fsdp2", "6.000", "50.0%", "4.500", "-25.0%", "+87.5%"]
    assert lines[update + 1].split() == ["lockstep", "5.000", "40.0%", "4.500", "-10.0%", "+56.2%"]
    assert lines[update + 2].split() == ["odc", "4.000", "25.0%", "4.000", "+0.0%", "+25.0%"]
    assert "on the fastest rank, summed over the phase's passes (no plan does better): update_actor 3.200 s" in text
    assert lines[update + 3].strip() == (
        "transport 1.200x (planner 1.000x); ODC+LB-Mini over lockstep 1.250x (planner 1.125x); "
        "odc over fsdp2 1.500x (planner 1.125x)"
    )
    for phase in ("old_log_prob", "ref", "training"):  # the phases these runs timed, and all of training
        assert any(line.startswith(phase) for line in lines), phase
    training = next(line for line in lines if line.startswith("training"))
    assert training.split()[1:3] == ["fsdp2", f"{12 - 6:.3f}"]  # step minus the rollout (gen, half the step)
    assert "control: the rollout, which no strategy touches, over fsdp2's: lockstep 1.09x, odc 1.33x" in text
    assert "peak memory of the whole run (PSS): odc 6.5 GiB" in text
    assert "NOTE: more than 10% off the planner: fsdp2 update_actor (-25.0%);" in text
    assert "nothing can be balanced" not in text
    # with one sample per rank (2 samples, 2 ranks) the report says that no plan can help
    times = {label: {"update_actor": [PhaseTime(4.0, 6.0, 2, 3.2, 2)] * 4} for label in ("fsdp2", "lockstep", "odc")}
    note = ab_report.phase_report(runs, times).splitlines()[-1]
    assert note.startswith("NOTE: update_actor (2 samples, 2 ranks): at most one sample per rank, so nothing can be")
