"""A/B report: a `fsdp2` run against an `odc` run of verl's trainer, from their logged metrics.

Reads the per-step metrics that verl's `file` logger (`trainer.logger=[...,file]`) writes: one JSON
object per `Tracking.log` call, `{"step": <global step>, "data": {<metric>: <value>}}`, one file per
run. Training steps are the records with `timing_s/step`; the first `--skip-first` of them are left out
(start-up: compilation, caches, vLLM warm-up), then every figure is the median over the remaining steps
and every speedup is a ratio of the two runs' medians (> 1: the candidate is faster).

Metrics read (verl 0.9.1 `compute_timing_metrics` / `compute_throughout_metrics`, our engines):
    timing_s/step                      one whole training step (end to end)
    timing_s/<phase>                   gen, old_log_prob, ref, values, update_critic, update_actor
    perf/total_num_tokens              prompt + response tokens of the step's batch
    perf/throughput                    total_num_tokens / (step time * number of GPUs)
    {actor,critic}/odc/compute_s_mean, wait_s_mean, wait_s_max, compute_imbalance,
    micro_batches_min, micro_batches_max   from the odc engines (absent in a fsdp2 run: n/a)
    odc_balance/efficiency, samples_min, samples_max   LB-Mini's plan for the actor (odc + lb_mini runs)
The update phase is update_actor + update_critic (the critic only when it ran); its throughput is
total_num_tokens / update phase time. Idle fraction = wait / (wait + compute) of the ODC mini-batches
(mean over ranks and mini-batches, per step).

    python -m odc_plugin.verl.ab_report RUN_DIR             # RUN_DIR/fsdp2.jsonl vs RUN_DIR/odc.jsonl
    python -m odc_plugin.verl.ab_report BASELINE.jsonl CANDIDATE.jsonl [--skip-first N] [--json]

`phase_report` compares any number of runs phase by phase (odc-grpo-cpu --compare fsdp2,lockstep,odc):
per FSDP phase each run's s/step, the factors between runs (RUN_FACTORS), and, for emulated runs, the
idle fraction and the planner's prediction for the plans each run ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..balance.lengths import read_metrics
from ..balance.step_time import off_planner_note, unbalanceable_note

if TYPE_CHECKING:
    from .cpu.emulation import PhaseTime

STEP = "timing_s/step"
TOKENS = "perf/total_num_tokens"
THROUGHPUT = "perf/throughput"
PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")
UPDATE_PHASES = ("update_actor", "update_critic")
TIMED = ("step", *PHASES)  # the timings a figure divides by
ROLES = ("actor", "critic")
ODC_STATS = (
    "compute_s_mean",
    "wait_s_mean",
    "wait_s_max",
    "compute_imbalance",
    "micro_batches_min",
    "micro_batches_max",
)
BALANCE = "odc_balance"
BALANCE_STATS = ("efficiency", "samples_min", "samples_max")


class ReportError(Exception):
    """The metric files cannot give the report (missing, empty, no training steps)."""


@dataclass
class Run:
    label: str
    path: str
    steps: dict[int, dict[str, float]] = field(default_factory=dict)  # training steps only, in order


def load_run(path: str, label: str | None = None, skip_first: int = 1) -> Run:
    """The run's training steps after the first `skip_first`."""
    label = label or os.path.splitext(os.path.basename(path))[0]
    try:
        records = read_metrics(path)
    except ValueError as e:
        raise ReportError(str(e)) from None
    training = {s: _as_ppo_keys(m) for s, m in sorted(records.items()) if STEP in m}
    for step, metrics in training.items():
        # Only the times the figures divide by are read as times: verl also logs counts under timing_s/ (its
        # agent loop's agent_loop/num_preempted/*, -1 where the rollout does not report preemptions).
        for key in (f"timing_s/{name}" for name in TIMED):
            if key in metrics and not metrics[key] > 0:
                raise ReportError(f"{path}: step {step} logs {key}={metrics[key]:g}; a measured time must be > 0")
    if len(training) <= skip_first:
        raise ReportError(
            f"{path}: {len(training)} training step(s) with {STEP}, need more than --skip-first={skip_first}"
        )
    kept = dict(list(training.items())[skip_first:])
    return Run(label=label, path=path, steps=kept)


# verl's SFT trainer's keys, and the PPO trainer's that mean the same: its one model is read as the actor
SFT_KEYS = {"train/global_tokens": TOKENS}


def _as_ppo_keys(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics under the PPO trainer's names: an SFT run's tokens and engine metrics (`odc/*`, as
    `actor/odc/*`); a PPO run's unchanged."""
    if "train/loss" not in metrics:
        return metrics
    renamed = {SFT_KEYS.get(k, f"actor/{k}" if k.startswith("odc/") else k): v for k, v in metrics.items()}
    return renamed


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _per_step(run: Run, fn) -> list[float]:
    out = []
    for metrics in run.steps.values():
        try:
            value = fn(metrics)
        except (KeyError, ZeroDivisionError):
            continue
        if value is not None:
            out.append(value)
    return out


def _update_time(m: dict[str, float]) -> float | None:
    present = [m[f"timing_s/{p}"] for p in UPDATE_PHASES if f"timing_s/{p}" in m]
    return sum(present) if present else None


def _update_rate(m: dict[str, float]) -> float | None:
    update = _update_time(m)
    return m[TOKENS] / update if update else None


def _idle_fraction(role: str):
    def fn(m: dict[str, float]) -> float | None:
        wait, compute = m[f"{role}/odc/wait_s_mean"], m[f"{role}/odc/compute_s_mean"]
        return wait / (wait + compute) if wait + compute > 0 else None

    return fn


def summarize(run: Run) -> dict[str, float | None]:
    """Medians over the run's kept steps; None where the run did not log what a figure needs."""
    s: dict[str, float | None] = {
        "steps": float(len(run.steps)),
        "step_s": _median(_per_step(run, lambda m: m[STEP])),
        "update_s": _median(_per_step(run, _update_time)),
        "update_tokens_per_s": _median(_per_step(run, _update_rate)),
        "tokens_per_s": _median(_per_step(run, lambda m: m[TOKENS] / m[STEP])),
        "tokens_per_s_per_gpu": _median(_per_step(run, lambda m: m[THROUGHPUT])),
        "tokens_per_step": _median(_per_step(run, lambda m: m[TOKENS])),
    }
    for phase in PHASES:
        s[f"{phase}_s"] = _median(_per_step(run, lambda m, p=phase: m[f"timing_s/{p}"]))
    for role in ROLES:
        s[f"{role}_idle_fraction"] = _median(_per_step(run, _idle_fraction(role)))
        for stat in ODC_STATS:
            s[f"{role}_odc_{stat}"] = _median(_per_step(run, lambda m, k=f"{role}/odc/{stat}": m[k]))
    for stat in BALANCE_STATS:
        s[f"balance_{stat}"] = _median(_per_step(run, lambda m, k=f"{BALANCE}/{stat}": m[k]))
    return s


# (key, label, kind): kind "time" -> speedup = base / candidate; "rate" -> candidate / base; "" -> none
ROWS = [
    ("update_s", "update phase s/step (update_actor + update_critic)", "time"),
    ("update_actor_s", "  update_actor s/step", "time"),
    ("update_critic_s", "  update_critic s/step", "time"),
    ("old_log_prob_s", "old_log_prob s/step", "time"),
    ("ref_s", "ref s/step", "time"),
    ("values_s", "values s/step", "time"),
    ("gen_s", "gen (rollout) s/step", "time"),
    ("step_s", "step s (end to end)", "time"),
    ("update_tokens_per_s", "update phase tokens/s", "rate"),
    ("tokens_per_s", "end-to-end tokens/s", "rate"),
    ("tokens_per_s_per_gpu", "end-to-end tokens/s/GPU (perf/throughput)", "rate"),
    ("tokens_per_step", "tokens/step", ""),
    ("actor_idle_fraction", "actor idle fraction (wait / (wait + compute))", ""),
    ("actor_odc_wait_s_mean", "  actor odc wait s (mean)", ""),
    ("actor_odc_wait_s_max", "  actor odc wait s (max)", ""),
    ("actor_odc_compute_s_mean", "  actor odc compute s (mean)", ""),
    ("actor_odc_compute_imbalance", "  actor compute max/mean", ""),
    ("actor_odc_micro_batches_min", "  actor micro-batches min", ""),
    ("actor_odc_micro_batches_max", "  actor micro-batches max", ""),
    ("critic_idle_fraction", "critic idle fraction (wait / (wait + compute))", ""),
    ("critic_odc_wait_s_mean", "  critic odc wait s (mean)", ""),
    ("critic_odc_compute_s_mean", "  critic odc compute s (mean)", ""),
    ("critic_odc_compute_imbalance", "  critic compute max/mean", ""),
    ("balance_efficiency", "LB-Mini plan efficiency (1 = no split does better)", ""),
    ("balance_samples_min", "  samples of one rank in a mini-batch, min", ""),
    ("balance_samples_max", "  samples of one rank in a mini-batch, max", ""),
]
ALWAYS = {"update_s", "step_s", "update_tokens_per_s", "tokens_per_s", "actor_idle_fraction"}


def speedup(base: float | None, cand: float | None, kind: str) -> float | None:
    if base is None or cand is None or kind == "":
        return None
    num, den = (base, cand) if kind == "time" else (cand, base)
    return num / den if den > 0 else None


def compare(base: Run, cand: Run) -> dict:
    b, c = summarize(base), summarize(cand)
    spreads = [x for x in (_spread(base), _spread(cand)) if x is not None]
    rows = []
    for key, label, kind in ROWS:
        if key not in ALWAYS and b[key] is None and c[key] is None:
            continue
        rows.append(
            {
                "key": key,
                "label": label,
                "baseline": b[key],
                "candidate": c[key],
                "speedup": speedup(b[key], c[key], kind),
            }
        )
    return {
        "baseline": {"label": base.label, "path": base.path, "steps": len(base.steps)},
        "candidate": {"label": cand.label, "path": cand.path, "steps": len(cand.steps)},
        "rows": rows,
        "speedup_update": speedup(b["update_s"], c["update_s"], "time"),
        "speedup_end_to_end": speedup(b["step_s"], c["step_s"], "time"),
        # The rollout is the same code under either strategy: how far its ratio is from 1 is how much of
        # any speedup above is the runs differing (order, caches, machine noise), not the strategy.
        "control_rollout": speedup(b["gen_s"], c["gen_s"], "time"),
        # Where no phase is left alone by the strategy (verl's SFT trainers): how far apart one run's own steps
        # are, the slowest over the fastest, in either run
        "control_steps": max(spreads, default=None),
    }


def _spread(run: Run) -> float | None:
    times = _per_step(run, lambda m: m[STEP])
    return max(times) / min(times) if len(times) > 1 and min(times) > 0 else None


def _fmt(value: float | None, key: str = "") -> str:
    if value is None:
        return "n/a"
    if "fraction" in key:
        return f"{100 * value:.1f}%"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"


def format_report(report: dict) -> str:
    b, c = report["baseline"], report["candidate"]
    width = max(len(r["label"]) for r in report["rows"])
    cols = max(10, len(b["label"]), len(c["label"]))
    lines = [
        f"A/B report: {b['label']} ({b['path']}, {b['steps']} steps) vs {c['label']} ({c['path']}, {c['steps']} steps)",
        "medians over steps; speedup = ratio of medians, > 1 means the candidate is faster",
        "",
        f"{'':{width}}  {b['label']:>{cols}}  {c['label']:>{cols}}  {'speedup':>8}",
    ]
    for r in report["rows"]:
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(
            f"{r['label']:{width}}  {_fmt(r['baseline'], r['key']):>{cols}}  "
            f"{_fmt(r['candidate'], r['key']):>{cols}}  {sp:>8}".rstrip()
        )
    up, e2e = report["speedup_update"], report["speedup_end_to_end"]
    lines += [
        "",
        f"speedup {c['label']} over {b['label']}: update phase "
        f"{'n/a' if up is None else f'{up:.2f}x'}, end to end {'n/a' if e2e is None else f'{e2e:.2f}x'}",
    ]
    control, steps = report["control_rollout"], report["control_steps"]
    if control is not None:
        lines.append(
            f"control: the rollout, which the strategy does not touch, {control:.2f}x; a speedup no "
            f"further from 1 than this is run-to-run difference, not the strategy"
        )
    elif steps is not None:
        lines.append(
            f"control: one run's own steps differ by up to {steps:.2f}x (slowest over fastest); a speedup no further "
            "from 1 than this is run-to-run difference, not the strategy"
        )
    return "\n".join(lines)


# The FSDP phases of a step, as verl times them (timing_s/<phase>), in the order a step runs them.
FSDP_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")
# What each pair of odc-grpo-cpu's runs measures (slower run, faster run), as odc-demo's rows do: the
# transport, the removed per-layer barriers (same plan), LB-Mini (same ODC), and the idea on one transport.
RUN_FACTORS = {
    "transport": ("fsdp2", "lockstep"),
    "barrier removal": ("lockstep", "odc_lb_micro"),
    "LB-Mini": ("odc_lb_micro", "odc"),
    "split": ("odc", "split"),
    "ODC+LB-Mini over lockstep": ("lockstep", "odc"),
    "odc over fsdp2": ("fsdp2", "odc"),
}
# All phases of a step but the rollout, which no strategy touches.
TRAINING = "training"
# What the driver spends per step on LB-Mini, summed over the stages it plans (odc_balance/[<stage>/]<key>):
# planning, and splitting each planned batch and handing the pieces to verl's dispatch.
DRIVER_KEYS = {"planning": "plan_s", "dispatch": "dispatch_s"}


def _phase_seconds(m: dict[str, float], phase: str) -> float:
    if phase == TRAINING:
        return m[STEP] - m["timing_s/gen"]
    return m[f"timing_s/{phase}"]


def _phase_steps(run: Run, phase: str) -> dict[int, float]:
    out = {}
    for step, m in run.steps.items():
        try:
            out[step] = _phase_seconds(m, phase)
        except KeyError:
            continue
    return out


def _ratio(slow: Mapping[int, float], fast: Mapping[int, float]) -> float | None:
    """Median over the steps both have of the per-step ratio (the runs see the same samples at each step)."""
    common = sorted(set(slow) & set(fast))
    return statistics.median(slow[s] / fast[s] for s in common) if common else None


def phase_report(
    runs: Sequence[Run],
    times: Mapping[str, Mapping[str, Sequence[PhaseTime]]] | None = None,
    memory_gib: Mapping[str, float] | None = None,
    emulated: str | None = None,
) -> str:
    """Per FSDP phase, and all training phases together, every run's median s/step and the factors.

    `times[label][phase][step - 1]` (emulated runs): the planner's time for the plans the run ran, the
    ranks' emulated compute and the limit, which give the prediction, its error, the idle fraction and
    the distance to the limit. Long because it is one table, row by row."""
    times, by_label = times or {}, {r.label: r for r in runs}
    width = max(12, *(len(r.label) for r in runs))
    lines = [
        f"per phase, medians over steps {_steps_span(runs)}" + (f"; {emulated}" if emulated else ""),
        f"{'phase':<14}{'run':<{width}}{'s/step':>9}{'idle':>8}{'planner':>9}{'error':>8}{'over limit':>12}",
    ]
    errors, limits, samples = {}, {}, {}
    phases = [p for p in FSDP_PHASES if any(_phase_steps(r, p) for r in runs)] + [TRAINING]
    for phase in phases:
        measured = {r.label: _phase_steps(r, phase) for r in runs}
        predicted = {}
        for label, steps in measured.items():
            phase_times = times.get(label, {}).get(phase)
            cells = ["n/a"] * 4
            if phase_times and steps:
                predicted[label] = {s: phase_times[s - 1].predicted_s for s in steps}
                idle = statistics.median(phase_times[s - 1].idle_fraction(t) for s, t in steps.items())
                error = statistics.median(predicted[label][s] / t - 1 for s, t in steps.items())
                over = statistics.median(t / phase_times[s - 1].limit_s - 1 for s, t in steps.items())
                errors[f"{label} {phase}"] = error
                limits.setdefault(phase, statistics.median(phase_times[s - 1].limit_s for s in steps))
                samples.setdefault(phase, (max(t.samples for t in phase_times), phase_times[0].ranks))
                cells = [
                    f"{idle:.1%}",
                    f"{statistics.median(predicted[label].values()):.3f}",
                    f"{error:+.1%}",
                    f"{over:+.1%}",
                ]
            median = f"{statistics.median(steps.values()):.3f}" if steps else "n/a"
            lines.append(
                f"{phase if label == runs[0].label else '':<14}{label:<{width}}{median:>9}"
                + "".join(f"{c:>{w}}" for c, w in zip(cells, (8, 9, 8, 12)))
            )
        factors = []
        for name, (slow, fast) in RUN_FACTORS.items():
            if slow in by_label and fast in by_label:
                value = _ratio(measured[slow], measured[fast])
                planned = _ratio(predicted[slow], predicted[fast]) if slow in predicted and fast in predicted else None
                if value is not None:
                    factors.append(f"{name} {value:.3f}x" + (f" (planner {planned:.3f}x)" if planned else ""))
        if factors:
            lines.append(f"{'':<14}" + "; ".join(factors))
    if limits:
        lines.append(
            "limit: per pass the larger of its emulated work over the ranks' summed speeds and its longest sample "
            "on the fastest rank, summed over the phase's passes (no plan does better): "
            + ", ".join(f"{p} {v:.3f} s" for p, v in limits.items())
        )
    gen = {r.label: _phase_steps(r, "gen") for r in runs}
    controls = [f"{r.label} {_ratio(gen[runs[0].label], gen[r.label]):.2f}x" for r in runs[1:] if gen[r.label]]
    if controls and gen[runs[0].label]:
        lines.append(
            f"control: the rollout, which no strategy touches, over {runs[0].label}'s: {', '.join(controls)}; a "
            "factor no further from 1 than these is run-to-run difference"
        )
    for r in runs:
        driver = {name: _median(_per_step(r, _driver_seconds(key))) for name, key in DRIVER_KEYS.items()}
        if driver["planning"] is not None:
            total = sum(v for v in driver.values() if v is not None)
            spent = ", ".join(f"{name} {v * 1e3:.1f} ms" for name, v in driver.items() if v is not None)
            lines.append(
                f"driver ({r.label}): LB-Mini {spent} per step, {total / _median(_per_step(r, lambda m: m[STEP])):.2%} "
                "of its step"
            )
    for r in runs:
        share = _per_step(r, _rebuild_share)
        if share:
            seconds = _median(_per_step(r, lambda m: _odc_sum(m, "rebuild_s")))
            held = max(_per_step(r, lambda m: _odc_sum(m, "held_outside_bytes")))
            lines.append(
                f"ODC's regions ({r.label}): built and released in {seconds * 1e3:.0f} ms per step (every odc role), "
                f"{_median(share):.2%} of its training time; held between phases, control words aside: {held:.0f} B"
            )
    if memory_gib:
        lines.append(
            "peak memory of the whole run (PSS): " + ", ".join(f"{k} {v:.1f} GiB" for k, v in memory_gib.items())
        )
    lines.append(
        "idle: the share of the ranks' time in the phase spent outside emulated compute; planner: the same "
        "plans, the same fit, compute only; error: planner over measured, minus 1; over limit: measured over "
        "the limit, minus 1"
        if times
        else "idle, planner and limit: emulated runs only (--emulate)"
    )
    for note in (off_planner_note(errors, "phase"), unbalanceable_note(samples)):
        if note:
            lines.append(f"NOTE: {note}")
    return "\n".join(lines)


def _odc_sum(m: dict[str, float], key: str) -> float | None:
    """A per-role odc memory metric summed over the roles (`<role>/odc/<key>`, the reference model's
    `actor/odc/ref/<key>` too); None when the run has none."""
    found = [v for k, v in m.items() if k.endswith(f"/odc/{key}") or k.endswith(f"/odc/ref/{key}")]
    return sum(found) if found else None


def _rebuild_share(m: dict[str, float]) -> float | None:
    spent = _odc_sum(m, "rebuild_s")
    return None if spent is None else spent / _phase_seconds(m, TRAINING)


def _driver_seconds(key: str):
    def fn(m: dict[str, float]) -> float | None:
        found = [v for k, v in m.items() if k.startswith(f"{BALANCE}/") and k.endswith(f"/{key}")]
        return sum(found) if found else None

    return fn


def _steps_span(runs: Sequence[Run]) -> str:
    steps = sorted({s for r in runs for s in r.steps})
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def split_prediction(run) -> str:
    """The trainer's planner on the split run's steps: LB-Mini's time without the split over the plan's, in
    the steps it priced in seconds (a static cost's first step has no measured throughput to price the
    all-to-alls with)."""
    ratios = [
        m["odc_balance/unsplit_predicted_s"] / m["odc_balance/split_predicted_s"]
        for m in run.steps.values()
        if m.get("odc_balance/split_predicted_s")
    ]
    if not ratios:
        return "split: the planner priced no step in seconds (a static cost is priced from its first update on)"
    return (
        f"split: the trainer's planner predicts the update {statistics.median(ratios):.3f}x faster with the split "
        f"than without (median over {len(ratios)} steps; odc_balance/unsplit_predicted_s / split_predicted_s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="odc-ab-report",
        description="Compare a fsdp2 run and an odc run of verl from their file-logger metrics.",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="a directory holding fsdp2.jsonl and odc.jsonl, or BASELINE.jsonl CANDIDATE.jsonl",
    )
    parser.add_argument(
        "--labels", nargs=2, metavar=("BASELINE", "CANDIDATE"), help="column names (default: the file names)"
    )
    parser.add_argument(
        "--skip-first",
        type=int,
        default=1,
        metavar="N",
        help="training steps left out at the start of each run (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    if len(args.runs) == 1 and os.path.isdir(args.runs[0]):
        paths = [os.path.join(args.runs[0], "fsdp2.jsonl"), os.path.join(args.runs[0], "odc.jsonl")]
    elif len(args.runs) == 2:
        paths = args.runs
    else:
        parser.error("give one run directory or two metric files")
    if args.skip_first < 0:
        parser.error("--skip-first must be >= 0")
    labels = args.labels or [None, None]
    try:
        base, cand = (load_run(p, label, args.skip_first) for p, label in zip(paths, labels))
        report = compare(base, cand)
    except ReportError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
