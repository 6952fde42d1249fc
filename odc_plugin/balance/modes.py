"""What a faster trainer does to a verl step in each trainer mode (`trainer.v1.trainer_mode`).

In every mode verl's trainer spends a step waiting for its batch (`timing_s/gen`: the replay buffer's
sample), running its passes (old and reference log-probs, values, the updates: what ODC runs) and the rest
(reward, advantages, the weight sync). Only the passes change under ODC; what the wait does depends on
where the rollout runs:

- `sync`: the rollout is the wait, the whole batch to its last response, on the trainer's GPUs;
- `colocate_async`: on the trainer's GPUs too, but partial: the wait lasts until enough responses finished
  (the rest go on next step), so the long tail no longer bounds it; it still adds to the step;
- `separate_async`: the rollout runs on GPUs of its own, all the time; the trainer waits only where the
  rollout is slower, so a step lasts the longer of the rollout's period and the trainer's own work, and a
  faster trainer gains only while it is the slower of the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Mode = Literal["sync", "colocate_async", "separate_async"]
MODES: tuple[Mode, ...] = ("sync", "colocate_async", "separate_async")
# verl's timing_s/* of the passes an odc engine runs
TRAINER_PASSES = ("old_log_prob", "ref", "values", "update_actor", "update_critic")


@dataclass(frozen=True)
class StepTimes:
    """One step of a verl run, as its trainer spent it."""

    wait_s: float
    """Waiting for the step's batch (timing_s/gen)."""
    passes_s: float
    """The passes an odc engine runs (TRAINER_PASSES), together."""
    other_s: float
    """The rest of timing_s/step."""

    @property
    def step_s(self) -> float:
        return self.wait_s + self.passes_s + self.other_s

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> StepTimes:
        """From one step of verl's metrics (its timing_s/* keys); ValueError where timing_s/step is missing."""
        if "timing_s/step" not in metrics:
            raise ValueError("a step's metrics without timing_s/step: not a verl PPO trainer's metrics")
        wait = float(metrics.get("timing_s/gen", 0.0))
        passes = sum(float(metrics.get(f"timing_s/{p}", 0.0)) for p in TRAINER_PASSES)
        return cls(wait, passes, max(0.0, float(metrics["timing_s/step"]) - wait - passes))


@dataclass(frozen=True)
class ModeStep:
    """A step predicted with the trainer's passes `passes_speedup` times as fast."""

    mode: Mode
    step_s: float
    bound: Literal["rollout", "trainer"]  # what the step waits for: the rollout, or the trainer's own work

    def speedup(self, before: ModeStep) -> float:
        return before.step_s / self.step_s


def predict_step(
    mode: Mode, times: StepTimes, passes_speedup: float = 1.0, rollout_period_s: float | None = None
) -> ModeStep:
    """The step of `mode` with the trainer's passes `passes_speedup` times as fast.

    `rollout_period_s` (separate_async): how long the rollout takes to generate a step's batch on its own
    GPUs. None: what `times` shows, the step itself where the trainer waited (the rollout bounded it), else
    no more than the trainer's own work (the rollout kept up: its period is not in the trainer's metrics,
    so the prediction assumes it keeps up).
    """
    if mode not in MODES:
        raise ValueError(f"trainer mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not passes_speedup > 0:
        raise ValueError(f"passes_speedup must be > 0, got {passes_speedup}")
    passes = times.passes_s / passes_speedup
    if mode != "separate_async":
        return ModeStep(mode, times.wait_s + passes + times.other_s, "rollout" if times.wait_s > passes else "trainer")
    own = passes + times.other_s
    if rollout_period_s is None:
        waited = times.wait_s > 0.05 * times.step_s  # more than polling's noise
        rollout_period_s = times.step_s if waited else 0.0
    return ModeStep(mode, max(own, rollout_period_s), "rollout" if rollout_period_s > own else "trainer")
