"""What one `odc-demo` run prints and draws: per row time, idle and prediction, the factors, and where
each rank's time went."""

from __future__ import annotations

import statistics

from ..balance.common import LIMIT_DEFINITION
from ..balance.step_time import off_planner_note, unbalanceable_note
from .rows import FACTORS

# Above this many ranks the table gives the spread of idle over ranks instead of every rank's split.
_RANKS_SPELLED_OUT = 4


def print_table(report: dict) -> None:
    ranks = report["config"]["ranks"]
    emulated = " (EMULATED layer compute)" if report["config"]["emulate"] else ""
    per_rank = "compute / comm / wait per rank" if ranks <= _RANKS_SPELLED_OUT else "idle min / max over ranks"
    print(
        f"\n{'row':<19}{'s/step':>8}{'tokens/s':>10}{'predicted':>11}{'error':>8}{'over limit':>11}{'idle':>7}"
        f"{'wait CPU':>10}   {per_rank}{emulated}"
    )
    for row, r in report["runs"].items():
        f = r["fraction_per_rank"]
        if ranks <= _RANKS_SPELLED_OUT:
            split = "  ".join(f"{f['compute'][k]:.2f}/{f['comm'][k]:.2f}/{f['wait'][k]:.2f}" for k in range(ranks))
        else:
            split = f"{min(f['wait']):.2f} / {max(f['wait']):.2f}"
        print(
            f"{row:<19}{r['median_step_s']:>8.3f}{r['tokens_per_s']:>10.0f}"
            f"{statistics.median(r['predicted_step_s']):>11.3f}{r['prediction_error']:>+8.1%}"
            f"{r['over_limit']:>+11.1%}{r['idle_fraction']:>7.1%}{r['wait_cpu_s']:>9.3f}s   {split}"
        )
    print(
        "error: the planner's step time over the measured one, minus 1 (median over mini-batches); over limit: "
        "the step time above the limit below (median over mini-batches); idle: the ranks' mean share of the step "
        "spent waiting; wait CPU: CPU seconds one rank spent in its waits per mini-batch (ODC: flags and "
        "barriers; fsdp2: gloo collectives, transfers included)"
    )
    print(
        f"limit: {statistics.median(report['limit_step_s']):.3f} s/step (median), per mini-batch {LIMIT_DEFINITION}: "
        "no plan does better"
    )
    if report.get("split_limit"):
        bounds = [lim["bound"] for lim in report["split_limit"]]
        splits = report["runs"]["odc+lb_mini+split"]["splits_per_minibatch"]
        print(
            f"limit with splitting: {statistics.median(lim['seconds'] for lim in report['split_limit']):.3f} s/step "
            f"(median), per mini-batch the larger of the work over the ranks plus the all-to-alls that splitting "
            f"needs, and the longest sample at its best split; it decided {bounds.count('work')} mini-batch(es) by "
            f"the work, {bounds.count('sample')} by a sample; split micro-batches run (over their members) per "
            f"mini-batch: {' '.join(map(str, splits))}"
        )
    notes = [
        off_planner_note({row: r["prediction_error"] for row, r in report["runs"].items()}, "row"),
        unbalanceable_note({"each mini-batch": (report["samples_per_minibatch"], report["config"]["ranks"])}),
    ]
    for note in filter(None, notes):
        print(f"NOTE: {note}")
    print(
        "planner's error per mini-batch: "
        + "; ".join(
            f"{row} " + " ".join(f"{e:+.0%}" for e in r["prediction_errors"]) for row, r in report["runs"].items()
        )
    )
    fits = [f for f in report["auto_fits"] or [] if f]
    if fits:
        last = fits[-1]
        print(
            f"auto cost, the last fit (of {last['timings']} micro-batch timings): c {last['c']:.3g} s + "
            f"a {last['a']:.3g} s/tok^2 + b {last['b']:.3g} s/tok; rank speeds {min(last['speeds']):.2f} to "
            f"{max(last['speeds']):.2f} (the prior, FLOPs, planned {len(report['auto_fits']) - len(fits)} "
            f"mini-batch(es) before it)"
        )
    print(f"\n{'factor':<16}{'from -> to':<38}{'measured':>9}{'predicted':>11}")
    for name, (slow, fast) in FACTORS.items():
        if name in report["factors"]:
            print(
                f"{name:<16}{slow + ' -> ' + fast:<38}{report['factors'][name]:>8.3f}x"
                f"{report['predicted_factors'][name]:>10.3f}x"
            )
    print(
        f"\nheadline, ODC+LB-Mini over the lockstep baseline on the same transport: "
        f"{report['factors']['odc+lb_mini']:.3f}x (median of per-mini-batch ratios){emulated}"
    )
    print(
        f"max |parameter difference| between rows after {report['config']['steps']} mini-batches: "
        f"{report['max_param_diff']:.2e}; memory of all ranks: {report['memory_mb'] / 1024:.1f} GiB (PSS)"
    )
    print(
        f"ODC's memory over FSDP2: {report['extra_bytes_per_param']:.3f} bytes per parameter, all ranks' "
        f"regions over all ranks' shards (the published shards in the gather dtype, the accumulator's padding and "
        f"flags, the zeros .grad points at)"
    )


def plot_breakdown(report: dict, path: str) -> None:
    """Per row a panel; per mini-batch a group of bars, one per rank, stacked compute / comm / wait."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks, steps = report["config"]["ranks"], report["config"]["steps"]
    colors = {"compute": "tab:green", "comm": "tab:blue", "wait": "tab:red"}
    rows = list(report["runs"])
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.6), sharey=True)
    width = 0.8 / ranks
    for ax, row in zip(axes, rows):
        r = report["runs"][row]
        for k in range(steps):
            for rank in range(ranks):
                x, bottom = k + (rank - (ranks - 1) / 2) * width, 0.0
                for part, color in colors.items():
                    value = r["breakdown"][k][rank][f"{part}_s"]
                    ax.bar(x, value, width * 0.9, bottom=bottom, color=color, label=part if k == rank == 0 else None)
                    bottom += value
            ax.hlines(
                r["predicted_step_s"][k],
                k - 0.45,
                k + 0.45,
                colors="black",
                linestyles="--",
                lw=1,
                label="planner's prediction" if k == 0 else None,
            )
        ax.set_title(f"{row}\nmedian {r['median_step_s']:.2f} s/step", fontsize=9)
        ax.set_xticks(range(steps), [str(k + 1) for k in range(steps)], fontsize=7)
        ax.set_xlabel(f"mini-batch (bars: ranks 0-{ranks - 1})", fontsize=8)
    axes[0].set_ylabel("seconds" + (" (emulated compute)" if report["config"]["emulate"] else ""))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        f"odc-demo, {report['config']['workload']} workload, {ranks} ranks: where each rank's time goes "
        f"(ODC+LB-Mini over lockstep: {report['factors']['odc+lb_mini']:.2f}x)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
