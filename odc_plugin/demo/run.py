"""One `odc-demo` run: the four rows trained by real CPU processes, the planner's prediction beside them.

Every row trains the same small Qwen2-architecture model from the same weights on the same mini-batches,
in the same processes, the rows taking turns mini-batch by mini-batch so that machine noise hits all
alike (rows and factors: rows.py). LB-Mini balances with a cost fit and the planner predicts each row's
step time from the same fit and the same plans: with real compute a fit a*s^2 + b*s calibrated on this
CPU first; with emulated compute (emulate.py) the GPU fit the layers' times are emulated from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import asdict

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..balance import CostModel, FitCost, FlopsCost, lb_micro, lb_mini
from ..balance.common import minibatch_limit
from ..balance.costs import fit_quadratic
from ..balance.online_fit import MicroBatchTime, OnlineTimeFit, lb_mini_auto
from ..balance.split import SplitPlan, UlyssesModel, lb_mini_split, split_limit
from ..balance.step_time import simulate_minibatch, simulate_split
from ..fsdp.ulysses import SequenceGroups
from ..launch import run_ranks
from ..layer_time import ComputeEmulator, EmulationFit, auto_time_scale
from ..models import MODEL_SIZES, build_model, qwen2_config, shard_qwen2
from .config import DemoConfig
from .report import plot_breakdown, print_table
from .rows import (
    AUTO_ROW,
    ROWS,
    SPLIT_ROW,
    build_rows,
    factors,
    final_param_diff,
    odc_extra_bytes,
    plan_of,
    step_breakdown,
    train_minibatch,
    turn_order,
)
from .workload import Sample, draw_minibatches, policy_loss, split_policy_loss


def calibration_lengths(cfg: DemoConfig) -> list[int]:
    lengths, s = [], 64
    while s <= cfg.max_token_len:
        lengths.append(s)
        s *= 2
    return lengths


def calibrate_body(rank, world, cfg: DemoConfig) -> list[list[float]]:
    """Forward+backward seconds of one sequence per length, on every rank at once (as in training,
    the ranks share the machine), on an unsharded copy of the model: compute only."""
    model = build_model(cfg.model_size, seed=cfg.seed)
    vocab = MODEL_SIZES[cfg.model_size].vocab_size
    points = []
    for length in calibration_lengths(cfg):
        sample = Sample(1, length - 1, 1.0, length)
        times = []
        for _ in range(4):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            policy_loss(model, [sample], vocab, length, 1).backward()
            times.append(time.perf_counter() - start)
        points.append([length, statistics.median(times[1:])])
    return points


def calibrate(cfg: DemoConfig) -> tuple[FitCost, list[list[float]]]:
    per_rank = run_ranks(calibrate_body, cfg.ranks, cfg)
    points = [[p[0][0], statistics.fmean(q[1] for q in p)] for p in zip(*per_rank)]
    a, b = fit_quadratic([p[0] for p in points], [p[1] for p in points])
    return FitCost(a, b), points


def emulation_fit(cfg: DemoConfig, batches: list[list[Sample]]) -> EmulationFit:
    """The fit the layers' times are emulated from, its time scale resolved ("auto": a rank's fair share
    of the mean mini-batch takes layer_time.AUTO_SHARE_S)."""
    if cfg.time_scale != "auto":
        return EmulationFit.load(cfg.emulate, cfg.time_scale)
    scale = auto_time_scale(cfg.emulate, ([s.total for s in batch] for batch in batches), cfg.ranks)
    return EmulationFit.load(cfg.emulate, scale)


def rows_of(cfg: DemoConfig) -> tuple[str, ...]:
    return ROWS + ((AUTO_ROW,) if cfg.cost == "auto" else ()) + ((SPLIT_ROW,) if cfg.split else ())


def ulysses_in_step_time(cfg: DemoConfig, fit: EmulationFit | None) -> UlyssesModel:
    """The split's all-to-alls in the unit of the demo's step times: emulated seconds are the GPU's times the
    time scale."""
    ulysses = cfg.ulysses()
    scale = fit.time_scale if fit else 1.0
    return dataclasses.replace(ulysses, bandwidth=ulysses.bandwidth / scale, latency_s=ulysses.latency_s * scale)


def plan_minibatches(cfg: DemoConfig, batches, cost: FitCost, ulysses: UlyssesModel) -> dict:
    """Per row whose plans are known before training, per mini-batch, per rank: micro-batches of sample
    indices; the split row's are SplitPlans. (The auto row's plans follow from what it measures, so its
    ranks make them as they go.)"""
    plans = {"lb_micro": [], "lb_mini": [], "split": []}
    for batch in batches:
        totals = [s.total for s in batch]
        plans["lb_micro"].append(lb_micro(totals, cfg.ranks, cfg.max_token_len))
        plans["lb_mini"].append(
            lb_mini(totals, cfg.ranks, cfg.max_token_len, cost=cost, baseline=plans["lb_micro"][-1])
        )
        if cfg.split:
            plans["split"].append(
                lb_mini_split(
                    totals, cfg.ranks, cfg.max_token_len, cost, ulysses=ulysses, baseline=plans["lb_mini"][-1]
                )
            )
    return {row: plans[plan_of(row)] for row in rows_of(cfg) if row != AUTO_ROW}


def auto_prior(cfg: DemoConfig, fit: EmulationFit | None) -> CostModel:
    """What the auto cost starts from: the FLOPs of the model whose compute runs (or is emulated)."""
    return FlopsCost.from_config(fit.model if fit else qwen2_config(cfg.model_size))


def _memory_mb() -> float:
    """This process's proportional share of resident memory (shared pages split among their users)."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024


def _gathered_timings(rank: int, batch, micro_batches, seconds) -> list[MicroBatchTime]:
    """Every rank's micro-batch timings of one mini-batch (collective)."""
    mine = [MicroBatchTime(rank, tuple(batch[i].total for i in mb), s) for mb, s in zip(micro_batches, seconds)]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [t for timings in every for t in timings]


def rank_body(
    rank, world, cfg: DemoConfig, batches, plans, fit: EmulationFit | None, prior: CostModel, ulysses: UlyssesModel
):
    """One rank's part of the demo; long because it is the one loop over mini-batches and rows that the timings must
    come from, in order.
    """
    mesh = init_device_mesh("cpu", (world,))
    vocab = MODEL_SIZES[cfg.model_size].vocab_size
    slowdown = cfg.slowdowns[rank]
    layers = MODEL_SIZES[cfg.model_size].num_hidden_layers
    emulator = ComputeEmulator(fit, slowdown, layers) if fit is not None or slowdown != 1.0 else None

    def build():
        model = shard_qwen2(build_model(cfg.model_size, seed=cfg.seed), mesh)
        if emulator:
            emulator.attach(model.model.layers)
        return model

    names = rows_of(cfg)
    rows = build_rows(build, "shm", lr=1e-5, names=names)
    groups = SequenceGroups(ulysses.group_sizes(world)[-1]) if SPLIT_ROW in names else None
    online = OnlineTimeFit(world)
    plans = dict(plans, **{AUTO_ROW: []}) if AUTO_ROW in names else plans

    def loss(model, samples: list[Sample], response_tokens: int):
        if emulator:
            emulator.micro_batch([s.total for s in samples])
        return policy_loss(model, [s.stand_in(cfg.stand_in) for s in samples], vocab, response_tokens, world)

    def split_loss(model, sample: Sample, ranks: range, response_tokens: int):
        """This rank's slice of a sample split over `ranks`: its share of the compute, and the all-to-alls."""
        if emulator:
            emulator.micro_batch([sample.total], 1 / len(ranks), ulysses.seconds(sample.total, len(ranks)))
        with groups.split(ranks) as member:
            return split_policy_loss(model, sample.stand_in(cfg.stand_in), vocab, response_tokens, world, member)

    record = {row: [] for row in names}
    auto_fits = []
    warm = [batches[0][rank % len(batches[0])]]
    for row in names:  # warm-up, untimed: one sample per rank, the first costs of every row paid here
        train_minibatch(rows[row], [lambda m=rows[row].model: loss(m, warm, world)])
    for step, batch in enumerate(batches):
        response_tokens = sum(s.stand_in(cfg.stand_in).response_len for s in batch)
        for row in turn_order(step, names):
            if row == AUTO_ROW:  # the same fit on every rank, so the same plan
                auto_fits.append(online.fit)
                plans[row].append(
                    lb_mini_auto(
                        [s.total for s in batch],
                        world,
                        cfg.max_token_len,
                        online.fit,
                        prior,
                        baseline=plans[ROWS[2]][step],
                    )
                )
            plan = plans[row][step]
            splits = [s for s in plan.splits if rank in s.group] if isinstance(plan, SplitPlan) else []
            micro_batches = plan.ranks[rank] if isinstance(plan, SplitPlan) else plan[rank]
            losses = [
                lambda s=s, m=rows[row].model, b=batch, r=response_tokens: split_loss(m, b[s.sample], s.group, r)
                for s in splits
            ] + [
                lambda mb=mb, m=rows[row].model, b=batch, r=response_tokens: loss(m, [b[i] for i in mb], r)
                for mb in micro_batches
            ]
            rec = train_minibatch(rows[row], losses)
            # a split sample is the first member's, and each member's k-th of its tokens
            rec["samples"] = [batch[s.sample].seed for s in splits if s.first == rank] + [
                batch[i].seed for mb in micro_batches for i in mb
            ]
            rec["tokens"] = sum(batch[s.sample].total / s.k for s in splits) + sum(
                batch[i].total for mb in micro_batches for i in mb
            )
            rec["splits"] = len(splits)
            record[row].append(rec)
            if row == AUTO_ROW:
                online.add(_gathered_timings(rank, batch, micro_batches, rec["micro_batch_s"]))
        if rank == 0:
            times = " | ".join(f"{row} {record[row][-1]['step_s']:.2f}s" for row in names)
            label = " (EMULATED compute)" if fit is not None else ""
            print(f"  mini-batch {step + 1}/{len(batches)}{label}: {times}", flush=True)
    return {
        "record": record,
        "max_param_diff": final_param_diff(rows),
        "memory_mb": _memory_mb(),
        "odc_extra_bytes": odc_extra_bytes(rows),
        "auto_plans": plans.get(AUTO_ROW),
        "auto_fits": [f and dataclasses.asdict(f) for f in auto_fits],
    }


def predict(cfg: DemoConfig, batches, plans, cost: FitCost, ulysses: UlyssesModel) -> dict[str, list[float]]:
    """The planner's compute-only step time of every row and mini-batch: lockstep rows last the sum over
    micro-batch steps of the slowest rank, ODC rows the slowest rank's sum, each rank's compute times
    its slowdown; the split row its split samples first (their compute over k and their all-to-alls). It
    has no transport in it, so it predicts the same time for the first two rows."""

    def seconds(row: str, plan, batch) -> float:
        lengths = [s.total for s in batch]
        if isinstance(plan, SplitPlan):
            return simulate_split(plan, cost.costs(lengths), lengths, ulysses, slowdown=cfg.slowdowns).seconds
        return simulate_minibatch(
            plan, cost.costs(lengths), lockstep=not row.startswith("odc"), slowdown=cfg.slowdowns
        ).seconds

    return {row: [seconds(row, plans[row][k], batch) for k, batch in enumerate(batches)] for row in plans}


def limit_step_s(cfg: DemoConfig, batches, cost: FitCost) -> list[float]:
    """Per mini-batch, the time no row can beat (common.minibatch_limit)."""
    return [minibatch_limit(cost.costs([s.total for s in batch]), cfg.slowdowns) for batch in batches]


def split_limits(cfg: DemoConfig, batches, cost: FitCost, ulysses: UlyssesModel) -> list[dict]:
    """Per mini-batch, the time no plan that may split samples beats, and which bound decides it: the work
    over the ranks plus the all-to-alls splitting needs, or the longest sample at its best split."""
    limits = []
    for batch in batches:
        lengths = [s.total for s in batch]
        limit = split_limit(cost.costs(lengths), lengths, cfg.slowdowns, ulysses)
        limits.append({"seconds": limit.seconds, "bound": limit.bound})
    return limits


def summarize(cfg: DemoConfig, batches, per_rank, predicted, limit, calibration, split_limit_s=None) -> dict:
    steps = range(cfg.steps)
    tokens = [sum(s.total for s in b) for b in batches]
    runs, step_s = {}, {}
    for row in rows_of(cfg):
        records = [[r["record"][row][k] for r in per_rank] for k in steps]
        step_s[row] = [max(rec["step_s"] for rec in recs) for recs in records]  # the slowest rank's
        parts = [step_breakdown(recs) for recs in records]  # [step][rank]
        fractions = {
            part: [sum(p[rank][f"{part}_s"] for p in parts) / sum(step_s[row]) for rank in range(cfg.ranks)]
            for part in ("compute", "comm", "wait")
        }
        runs[row] = {
            "median_step_s": statistics.median(step_s[row]),
            "step_s": step_s[row],
            "tokens_per_s": sum(tokens) / sum(step_s[row]),
            "idle_fraction": statistics.fmean(fractions["wait"]),
            "fraction_per_rank": fractions,
            # per rank and mini-batch, the mean: wall seconds waiting, and the CPU seconds those waits took
            "wait_s": statistics.fmean(p["wait_s"] for step in parts for p in step),
            "wait_cpu_s": statistics.fmean(rec["wait_cpu_s"] for recs in records for rec in recs),
            "breakdown": [[{k: v for k, v in p.items() if k != "barriers"} for p in step] for step in parts],
            "barriers_per_rank": [[p["barriers"] for p in step] for step in parts],
            "micro_batches_per_rank": [[rec["micro_batches"] for rec in recs] for recs in records],
            "tokens_per_rank": [[rec["tokens"] for rec in recs] for recs in records],
            "samples_per_rank": [[rec["samples"] for rec in recs] for recs in records],
            "predicted_step_s": predicted[row],
            "prediction_errors": [p / m - 1 for p, m in zip(predicted[row], step_s[row])],
            "prediction_error": statistics.median(p / m - 1 for p, m in zip(predicted[row], step_s[row])),
            "over_limit": statistics.median(m / lim - 1 for m, lim in zip(step_s[row], limit)),
        }
        if row == SPLIT_ROW:  # against the limit of plans that may split
            runs[row]["over_limit"] = statistics.median(
                m / lim["seconds"] - 1 for m, lim in zip(step_s[row], split_limit_s)
            )
            runs[row]["splits_per_minibatch"] = [
                sum(rec["splits"] for rec in recs) for recs in records
            ]  # members' split micro-batches
    return {
        "config": asdict(cfg),
        "runs": runs,
        "factors": factors(step_s),
        "predicted_factors": factors(predicted),
        "samples_per_minibatch": cfg.samples_per_minibatch,
        "limit_step_s": limit,
        "split_limit": split_limit_s,
        "calibration": calibration,
        "max_param_diff": max(r["max_param_diff"] for r in per_rank),
        "memory_mb": sum(r["memory_mb"] for r in per_rank),
        "extra_bytes_per_param": sum(r["odc_extra_bytes"][0] for r in per_rank)
        / max(sum(r["odc_extra_bytes"][1] for r in per_rank), 1),
        "auto_fits": per_rank[0]["auto_fits"],  # the fit each auto mini-batch was planned with (None: prior)
    }


def run_demo(cfg: DemoConfig, quiet: bool = False) -> dict:
    """Train the four rows, print the table (unless `quiet`), write the JSON report and the PNG."""
    say = (lambda *a, **k: None) if quiet else print
    batches = draw_minibatches(cfg)
    say(
        f"odc-demo: {cfg.ranks} CPU ranks x 1 thread, model '{cfg.model_size}', {cfg.workload} workload, "
        f"{cfg.steps} mini-batches of {len(batches[0])} samples, micro-batch budget {cfg.max_token_len} tokens",
        flush=True,
    )
    fit = None
    if cfg.emulate:
        fit = emulation_fit(cfg, batches)
        cost, calibration = fit.cost, {"emulated": fit.source, "cost": asdict(fit.cost), "time_scale": fit.time_scale}
        say(
            f"layer compute EMULATED from {fit.source}, time scale {fit.time_scale:.3g}: {fit.num_layers} layers' "
            f"seconds per sequence {fit.cost.a:.3g} s^2 + {fit.cost.b:.3g} s, backward {fit.backward_ratio:g}x "
            f"forward; the model computes on {cfg.stand_in}x shorter stand-in sequences",
            flush=True,
        )
    else:
        cost, calibration = calibrate(cfg)
        say(f"cost fit on this CPU: t(s) = {cost.a:.3g} s^2 + {cost.b:.3g} s seconds per sequence", flush=True)
    if any(f != 1.0 for f in cfg.slowdowns):
        say(f"slow ranks: {', '.join(f'{r}: {f:g}x' for r, f in enumerate(cfg.slowdowns) if f != 1.0)}", flush=True)
    ulysses = ulysses_in_step_time(cfg, fit)
    plans = plan_minibatches(cfg, batches, cost, ulysses)
    per_rank = run_ranks(rank_body, cfg.ranks, cfg, batches, plans, fit, auto_prior(cfg, fit), ulysses)
    if cfg.cost == "auto":
        plans[AUTO_ROW] = per_rank[0]["auto_plans"]
    report = summarize(
        cfg,
        batches,
        per_rank,
        predict(cfg, batches, plans, cost, ulysses),
        limit_step_s(cfg, batches, cost),
        calibration,
        split_limits(cfg, batches, cost, ulysses) if cfg.split else None,
    )
    os.makedirs(cfg.out_dir, exist_ok=True)
    json_path, png_path = os.path.join(cfg.out_dir, "odc_demo.json"), os.path.join(cfg.out_dir, "odc_demo.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    plot_breakdown(report, png_path)
    if not quiet:
        print_table(report)
        print(f"report: {json_path}\npicture: {png_path}")
    return report
