"""`odc-demo --emulate FIT --sweep-ranks 4 8 16 32`: ODC at the scale it is for, held against the planner.

At each rank count, for the RL and the SFT workload, the four rows run as in a single `odc-demo` with
layer compute emulated from a GPU cost fit (emulate.py; everything else real), and the measured
ODC+LB-Mini-over-lockstep factor is set beside the planner's prediction on the same mini-batches and
plans. The workloads (CASES) match `odc-plan`'s cases for a Qwen2.5-7B layer fit on an H100.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Sequence

from ..balance import FitCost
from ..balance.common import LIMIT_DEFINITION
from ..balance.lengths import RL_PROFILE, plan_lengths
from ..balance.step_time import off_planner_note, plan_table, unbalanceable_note
from .config import DemoConfig
from .run import run_demo

CASES = {
    # the micro-batch budget just holds the longest sample
    "rl": {**RL_PROFILE, "max_token_len": sum(RL_PROFILE.values()), "group_size": 4},
    "sft": {"mini_batch_size": 256, "max_token_len": 32768},
}
ABOUT = {
    "rl": "GRPO rollouts: prompts up to 512 tokens, responses up to 16384, 4 responses per prompt and one prompt "
    "per rank (4 samples per rank), micro-batch budget 16896 tokens (the longest sample)",
    "sft": "long-context SFT: 256 samples per mini-batch (64 per rank at 4 ranks, 8 at 32), chats around 1k "
    "tokens and 30% documents of 4k to 32k, micro-batch budget 32768 tokens",
}
HEADLINE = "odc+lb_mini"


def minibatch_samples(workload: str, ranks: int) -> int:
    return ranks * CASES["rl"]["group_size"] if workload == "rl" else CASES[workload]["mini_batch_size"]


def odc_plan_speedups(fit_file: str, workload: str, ranks: Sequence[int]) -> dict[int, float]:
    """What `odc-plan` predicts for the case, ODC+LB-Mini over FSDP+LB-Micro at each rank count (its own
    draws of the case's lengths, the fit's cost); rank counts whose mini-batch does not divide are left out."""
    case = CASES[workload]
    if workload == "rl":
        draw = plan_lengths(
            "rl", max_prompt_length=case["max_prompt_length"], max_response_length=case["max_response_length"]
        ).draw
    else:
        draw = plan_lengths("sft", max_length=case["max_token_len"]).draw
    cost = FitCost.from_file(fit_file)
    speedups = {}
    for n in ranks:
        for row in plan_table(draw, [n], [minibatch_samples(workload, n)], case["max_token_len"], cost=cost):
            speedups[n] = row.speedup("odc_lb_mini")
    return speedups


def about(workload: str, speedups: dict[int, float]) -> str:
    planned = ", ".join(f"{s:.2f}x at {n} ranks" for n, s in speedups.items())
    return f"{ABOUT[workload]}; odc-plan (ODC+LB-Mini over FSDP+LB-Micro): {planned or 'no rank count divides'}"


def case_config(base: DemoConfig, workload: str, ranks: int) -> DemoConfig:
    """`base` (fit, steps, seed, slow ranks, ...) with the workload's case at `ranks` ranks."""
    case = dict(CASES[workload])
    if workload == "rl":
        case["mini_batch_size"] = ranks  # one prompt, so 4 responses, per rank
    return dataclasses.replace(
        base,
        workload=workload,
        ranks=ranks,
        lengths=None,
        out_dir=os.path.join(base.out_dir, f"{workload}-{ranks}"),
        **case,
    )


def point_summary(cfg: DemoConfig, report: dict) -> dict:
    """What the sweep keeps of one run."""
    runs = report["runs"]
    measured, predicted = report["factors"][HEADLINE], report["predicted_factors"][HEADLINE]
    return {
        "workload": cfg.workload,
        "ranks": cfg.ranks,
        "samples_per_minibatch": cfg.samples_per_minibatch,
        "time_scale": report["calibration"]["time_scale"],
        "rows": {
            row: {
                "median_step_s": r["median_step_s"],
                "idle_fraction": r["idle_fraction"],
                "predicted_step_s": statistics.median(r["predicted_step_s"]),
                "wait_cpu_s": r["wait_cpu_s"],
                "over_limit": r["over_limit"],
            }
            for row, r in runs.items()
        },
        "factors": report["factors"],
        "predicted_factors": report["predicted_factors"],
        "headline": measured,
        "predicted_headline": predicted,
        "relative_error": predicted / measured - 1,
        "limit_step_s": statistics.median(report["limit_step_s"]),
        "max_param_diff": report["max_param_diff"],
        "memory_gib": report["memory_mb"] / 1024,
    }


def run_sweep(base: DemoConfig, ranks: Sequence[int], workloads: Sequence[str]) -> dict:
    print(
        f"odc-demo sweep: {', '.join(workloads)} at {', '.join(map(str, ranks))} ranks, layer compute EMULATED "
        f"from {base.emulate} (the rest real), {base.steps} timed mini-batches per row"
    )
    cases = {w: about(w, odc_plan_speedups(base.emulate, w, ranks)) for w in workloads}
    for workload in workloads:
        print(f"  {workload}: {cases[workload]}")
    points = []
    for workload in workloads:
        for n in ranks:
            cfg = case_config(base, workload, n)
            point = point_summary(cfg, run_demo(cfg, quiet=True))
            points.append(point)
            steps = " | ".join(f"{row} {p['median_step_s']:.2f}" for row, p in point["rows"].items())
            print(
                f"{workload:<4}{n:>3} ranks: {steps} s/step; ODC+LB-Mini over lockstep {point['headline']:.3f}x, "
                f"planner {point['predicted_headline']:.3f}x ({point['relative_error']:+.1%})",
                flush=True,
            )
    result = {"config": dataclasses.asdict(base), "cases": cases, "points": points}
    os.makedirs(base.out_dir, exist_ok=True)
    json_path, png_path = (os.path.join(base.out_dir, f"odc_sweep.{ext}") for ext in ("json", "png"))
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    plot_sweep(result, png_path)
    print_sweep(result)
    print(f"report: {json_path}\npicture: {png_path}")
    return result


def print_sweep(result: dict) -> None:
    rows = list(result["points"][0]["rows"])
    print(
        f"\n{'':<10}" + "".join(f"{row:>26}" for row in rows) + f"{'limit':>8}{'ODC+LB-Mini/lockstep':>22}"
        f"{'planner':>9}{'error':>8}{'memory':>9}"
    )
    print(f"{'':<10}" + f"{'s/step  idle  >limit':>26}" * len(rows) + f"{'s/step':>8}{'measured':>22}")
    for p in result["points"]:
        cells = "".join(
            f"{r['median_step_s']:>12.3f}{r['idle_fraction']:>7.1%}{r['over_limit']:>+7.1%}" for r in p["rows"].values()
        )
        print(
            f"{p['workload']:<4}{p['ranks']:>3} rk{cells}{p['limit_step_s']:>8.3f}{p['headline']:>21.3f}x"
            f"{p['predicted_headline']:>8.3f}x{p['relative_error']:>+8.1%}{p['memory_gib']:>6.1f}GiB"
        )
    print(
        f"EMULATED layer compute (the rest real); >limit: the row's step time above the limit (per mini-batch "
        f"{LIMIT_DEFINITION}), median over mini-batches; error: planner over measured factor, minus 1; memory: all "
        "ranks' PSS"
    )
    labels = {f"{p['workload']} at {p['ranks']} ranks": p for p in result["points"]}
    notes = [
        off_planner_note({label: p["relative_error"] for label, p in labels.items()}, "point"),
        unbalanceable_note({label: (p["samples_per_minibatch"], p["ranks"]) for label, p in labels.items()}),
    ]
    for note in filter(None, notes):
        print(f"NOTE: {note}")


def plot_sweep(result: dict, path: str) -> None:
    """One panel per workload: measured ODC+LB-Mini-over-lockstep factor per rank count, the planner's
    beside it, every point labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(p["workload"] for p in result["points"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        points = [p for p in result["points"] if p["workload"] == workload]
        ranks = [p["ranks"] for p in points]
        for key, style, label in (
            ("headline", "o-", "measured (emulated compute)"),
            ("predicted_headline", "s--", "planner, same plans"),
        ):
            values = [p[key] for p in points]
            ax.plot(ranks, values, style, label=label, color="tab:green" if key == "headline" else "tab:gray")
            for x, y in zip(ranks, values):
                offset = (0, 8) if key == "headline" else (0, -14)
                ax.annotate(
                    f"{y:.2f}x",
                    (x, y),
                    textcoords="offset points",
                    xytext=offset,
                    ha="center",
                    fontsize=9,
                    color="tab:green" if key == "headline" else "tab:gray",
                )
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.minorticks_off()
        top = max(max(p["headline"], p["predicted_headline"]) for p in points)
        ax.set_ylim(0.9, max(1.1, top + 0.1))
        ax.set_xlabel("ranks")
        ax.set_ylabel("speedup over lockstep (same transport)")
        ax.set_title(f"{workload}: ODC+LB-Mini over FSDP-style lockstep + LB-Micro", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "odc-demo --sweep-ranks: layer compute EMULATED from a GPU fit;\nFSDP2, transport, barriers, "
        "plans and optimizer real",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
