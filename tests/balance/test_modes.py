"""A faster trainer in each of verl's trainer modes (odc_plugin/balance/modes.py), against steps worked out
by hand."""

from __future__ import annotations

import pytest

from odc_plugin.balance.modes import StepTimes, predict_step

# a step: 30 s waiting for the batch, 60 s of passes, 10 s of the rest
STEP = StepTimes(wait_s=30.0, passes_s=60.0, other_s=10.0)


def test_sync_and_colocate_async_add_the_wait_to_the_faster_passes():
    for mode in ("sync", "colocate_async"):
        step = predict_step(mode, STEP, passes_speedup=1.5)
        assert step.step_s == pytest.approx(30 + 40 + 10) and step.bound == "trainer"
        assert step.speedup(predict_step(mode, STEP)) == pytest.approx(100 / 80)


def test_separate_async_gains_only_while_the_trainer_is_the_slower():
    """The rollout on its own GPUs: a step lasts the longer of its period and the trainer's work."""
    trainer_bound = StepTimes(wait_s=0.0, passes_s=90.0, other_s=10.0)  # the rollout kept up
    step = predict_step("separate_async", trainer_bound, passes_speedup=1.5)
    assert step.step_s == pytest.approx(70.0) and step.bound == "trainer"
    # the rollout's period given (e.g. the decode model's): 80 s bounds the step once the trainer needs 70
    step = predict_step("separate_async", trainer_bound, passes_speedup=1.5, rollout_period_s=80.0)
    assert step.step_s == pytest.approx(80.0) and step.bound == "rollout"
    # the trainer waited 30 s of its 100: the rollout's period is the step, and a faster trainer waits longer
    step = predict_step("separate_async", STEP, passes_speedup=1.5)
    assert step.step_s == pytest.approx(100.0) and step.bound == "rollout"


def test_step_times_from_verls_metrics_and_the_errors():
    metrics = {"timing_s/step": 100.0, "timing_s/gen": 30.0, "timing_s/old_log_prob": 10.0, "timing_s/ref": 8.0}
    metrics |= {"timing_s/update_actor": 42.0, "timing_s/reward": 4.0}
    assert StepTimes.from_metrics(metrics) == StepTimes(30.0, 60.0, 10.0)
    with pytest.raises(ValueError, match="without timing_s/step"):
        StepTimes.from_metrics({"timing_s/gen": 1.0})
    with pytest.raises(ValueError, match="trainer mode must be one of"):
        predict_step("fully_async", STEP)
    with pytest.raises(ValueError, match="passes_speedup must be > 0"):
        predict_step("sync", STEP, passes_speedup=0)
