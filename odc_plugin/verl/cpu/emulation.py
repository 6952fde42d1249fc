"""verl's trainer at the scale ODC is for, on a laptop: layer compute emulated from a GPU fit, responses of
a stated length, every FSDP pass recorded (`odc-grpo-cpu --emulate`).

What a run emulates is an `Emulation`, saved as JSON next to the run and named to every Ray process by
the environment (`EMULATION_ENV`):

- the training ranks' decoder layers (actor, reference, critic; every strategy) take the fit's time for
  their micro-batch's true lengths (odc_plugin.layer_time, patches/cpu_layer_time.py), each real token
  standing for `length_factor` true ones;
- the `hf` rollout generates each response for real, to a length drawn from `response_lengths` (true
  tokens, over the length factor), so the training passes see a reasoning workload's long tail;
- each rank records every pass it runs (one FSDP mini-batch: its phase and the real lengths of each of
  its micro-batches) under `passes_dir`, from which `phase_times` gives, per step and phase, what the
  planner predicts for exactly those plans and how much of the ranks' time was emulated compute.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...balance.common import minibatch_limit
from ...balance.lengths import RL_PROFILE, load_lengths, rl_math_like
from ...balance.rollout_time import DecodeModel
from ...balance.step_time import simulate_minibatch
from ...layer_time import EmulationFit
from . import EMULATION_ENV

# The response-length profile named by "rl": the rl case of odc-demo's sweep.
RL_LENGTHS = "rl"
# verl's step-time metrics (timing_s/<phase>) of the passes the engines run, and whether they train.
PHASES = {"update_actor": True, "old_log_prob": False, "ref": False, "values": False, "update_critic": True}


@dataclass(frozen=True)
class Emulation:
    """What an emulated run changes; None fields leave that part real."""

    fit: str | None
    """A cost calibration JSON (benchmarks/calibrate_cost.py): the decoder layers take its time for the true
    lengths; None: they compute for real."""

    time_scale: float = 1.0
    """Emulated seconds are the fit's seconds times this."""

    length_factor: int = 1
    """Each real token stands for this many true tokens: in the emulated time and in drawn response lengths."""

    response_lengths: str | None = None
    """"rl" (rl_math_like at odc-demo's sweep scale: median about 4.9k tokens, up to 16384) or a lengths file
    (odc_plugin.balance.load_lengths), in true tokens; each response is generated to a length drawn from it.
    None: responses end where the model ends them."""

    rollout_fit: str | None = None
    """A decode fit file (configs/cost_fit/*-decode.json, odc_plugin.balance.rollout_time): the `hf` rollout
    holds each response until a GPU inference server would have generated it (the model's seconds times
    time_scale, the prompt's and response's true lengths); None: the rollout takes the CPU's own time."""

    rollout_servers: int = 1
    """The GPU inference servers the rollout stands for (with rollout_fit): requests are dealt round-robin
    over that many modelled servers, each its own continuous batch."""

    passes_dir: str | None = None
    """Where every rank records the passes it runs (one JSON line per FSDP mini-batch), and the rollout each
    response's modelled and real finish; None: not recorded."""

    def __post_init__(self):
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {self.time_scale}")
        if not (isinstance(self.length_factor, int) and self.length_factor >= 1):
            raise ValueError(f"--length-factor must be an integer >= 1, got {self.length_factor!r}")
        if not (isinstance(self.rollout_servers, int) and self.rollout_servers >= 1):
            raise ValueError(f"--rollout-servers must be an integer >= 1, got {self.rollout_servers!r}")
        if self.rollout_fit and not self.response_lengths:
            raise ValueError("a rollout fit needs drawn response lengths (--response-lengths)")

    def check(self) -> None:
        """Read the fit and the length profile now, so that a bad one is a one-line error before any run."""
        self.layer_fit()
        self.max_response_tokens()
        self.decode_model()

    def decode_model(self) -> DecodeModel | None:
        return None if self.rollout_fit is None else DecodeModel.load(self.rollout_fit)

    def layer_fit(self) -> EmulationFit | None:
        return None if self.fit is None else EmulationFit.load(self.fit, self.time_scale)

    def true_lengths(self, lengths: Sequence[int]) -> list[int]:
        return [self.length_factor * int(s) for s in lengths]

    def _profile(self) -> list[int] | None:
        """The lengths file's lengths; None for the rl profile."""
        if self.response_lengths == RL_LENGTHS:
            return None
        try:
            return load_lengths(self.response_lengths)
        except ValueError as e:
            raise ValueError(f"--response-lengths: neither {RL_LENGTHS!r} nor a usable lengths file: {e}") from None

    def max_response_tokens(self) -> int | None:
        """The longest response the profile can draw, in real tokens (what the rollout must allow)."""
        if self.response_lengths is None:
            return None
        lengths = self._profile()
        longest = RL_PROFILE["max_response_length"] if lengths is None else max(lengths)
        return max(1, math.ceil(longest / self.length_factor))

    def response_tokens(self, seed: int) -> int:
        """The real length of the response drawn with `seed` (a request's own seed: the same in every run)."""
        lengths = self._profile()
        if lengths is None:
            true = rl_math_like(1, **RL_PROFILE, seed=seed).response_lens[0]
        else:
            true = lengths[int(np.random.default_rng(seed).integers(len(lengths)))]
        return max(1, math.ceil(true / self.length_factor))

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def from_env(cls) -> Emulation | None:
        """The run's emulation (EMULATION_ENV names its file), or None in a run that emulates nothing."""
        path = os.environ.get(EMULATION_ENV)
        if not path:
            return None
        return cls(**json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------------------
# passes: what every rank ran, and what the planner says those plans are worth
# ---------------------------------------------------------------------------------------------


def record_pass(passes_dir: str, rank: int, phase: str, micro_batches: list[list[int]], seconds: float) -> None:
    """One FSDP mini-batch as this rank ran it: its micro-batches' real sequence lengths, its wall seconds."""
    line = json.dumps({"rank": rank, "phase": phase, "micro_batches": micro_batches, "seconds": seconds})
    with open(os.path.join(passes_dir, f"passes-{os.getpid()}.jsonl"), "a", encoding="utf-8") as fp:
        fp.write(line + "\n")  # one short append per mini-batch: whole lines, however processes interleave


@dataclass(frozen=True)
class PhaseTime:
    """One phase of one step, summed over its passes."""

    predicted_s: float  # the planner: the same plans, the fit, each rank's slowdown
    busy_rank_s: float  # emulated compute of all ranks together
    ranks: int
    limit_s: float  # per pass common.minibatch_limit of its samples, summed: no plan does better
    samples: int  # the most samples of any of the step's passes

    def idle_fraction(self, measured_s: float) -> float:
        """The share of the ranks' time in the measured phase not spent in emulated compute."""
        return 1 - self.busy_rank_s / (self.ranks * measured_s)


def rollout_lateness(passes_dir: str) -> str | None:
    """How the held rollout of a run went (Emulation.rollout_fit): its responses, and those the CPU generated
    later than the decode model's finish (the rollout's time then is the CPU's, not the model's)."""
    records = [
        json.loads(line)
        for path in sorted(Path(passes_dir).glob("rollout-*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
    ]
    if not records:
        return None
    late = [r["cpu_late_s"] for r in records if r["cpu_late_s"] > 0]
    median = np.median([r["seconds"] for r in records])
    text = f"{len(records)} responses held to the decode model (median {median:.2f} s from arrival)"
    if late:
        return text + f"; {len(late)} came later, by up to {max(late):.2f} s (the CPU's own generation)"
    return text + "; none came later than modelled"


def read_passes(passes_dir: str, key: str) -> dict[str, dict[int, list]]:
    """phase -> rank -> `key` of each of that rank's passes in order (`micro_batches`: its micro-batches' real
    lengths; `seconds`: its wall time)."""
    out: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(Path(passes_dir).glob("passes-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            out[record["phase"]][record["rank"]].append(record[key])
    return {phase: dict(ranks) for phase, ranks in out.items()}


def load_passes(passes_dir: str) -> dict[str, dict[int, list[list[list[int]]]]]:
    """phase -> rank -> that rank's passes in order, each a list of micro-batches of real lengths."""
    return read_passes(passes_dir, "micro_batches")


def phase_times(
    emulation: Emulation, passes_dir: str, steps: int, slowdowns: Sequence[float], lockstep: bool
) -> dict[str, list[PhaseTime]]:
    """Per phase, per training step, the planner's time of the passes the ranks ran and their emulated
    compute. Every step runs each phase the same number of times (one pass per forward-only phase, one
    per mini-batch and epoch of an update), so a rank's k-th pass of a phase belongs to step
    k // passes_per_step. `lockstep`: FSDP's per-layer synchronization (fsdp2, or odc's lockstep
    baseline), where every micro-batch step lasts as long as its slowest rank; else ODC's. Long because it
    is one walk over phases, steps, passes and ranks."""
    fit = emulation.layer_fit()
    if fit is None:
        raise ValueError("phase times need an emulated run (a fit)")
    out = {}
    for phase, by_rank in load_passes(passes_dir).items():
        ranks = len(slowdowns)
        counts = {len(by_rank.get(r, [])) for r in range(ranks)}
        if len(counts) != 1 or next(iter(counts)) % steps:
            raise ValueError(
                f"{passes_dir}: {phase} has {sorted(counts)} passes per rank, not the same multiple of {steps} steps"
            )
        per_step = next(iter(counts)) // steps
        seconds = fit.seconds if PHASES[phase] else fit.forward_seconds
        times = []
        for step in range(steps):
            predicted = busy = limit = 0.0
            samples = 0
            for k in range(step * per_step, (step + 1) * per_step):
                costs, plan = [], []
                for r in range(ranks):
                    plan.append([])
                    for lengths in by_rank[r][k]:
                        plan[-1].append([len(costs)])
                        costs.append(seconds(emulation.true_lengths(lengths)))
                predicted += simulate_minibatch(plan, costs, lockstep=lockstep, slowdown=slowdowns).seconds
                busy += sum(costs[i] * f for rank, f in zip(plan, slowdowns) for mb in rank for i in mb)
                each = [seconds(emulation.true_lengths([n])) for r in range(ranks) for mb in by_rank[r][k] for n in mb]
                limit += minibatch_limit(each, slowdowns)
                samples = max(samples, len(each))
            times.append(PhaseTime(predicted, busy, ranks, limit, samples))
        out[phase] = times
    return out
