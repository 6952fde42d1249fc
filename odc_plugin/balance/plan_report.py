"""What `odc-plan` prints and draws: the tables of the step-time model's rows, and their plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

from odc_plugin.balance.step_time import (
    CLUSTER_SCHEMES,
    SCHEMES,
    SPEEDUP_BASELINE,
    SPLIT_SCHEME,
    ClusterModel,
    ClusterRow,
    PlanRow,
)

SPEEDUP_OVER = f"speedup over {SCHEMES[SPEEDUP_BASELINE]}"


def format_table(rows: Sequence[PlanRow]) -> str:
    columns = [  # (group, header, cell of a row)
        ("", "ranks", lambda r: f"{r.dp_size * r.sp}"),
        ("", "mini-batch", lambda r: f"{r.minibatch_size}"),
        ("", "per rank", lambda r: f"{r.minibatch_size // r.dp_size}"),
    ]
    if any(r.sp > 1 for r in rows):  # "per rank" is then per sequence-parallel group
        columns.insert(1, ("", "sp", lambda r: f"{r.sp}"))
    schemes = {s: name for s, name in SCHEMES.items() if all(s in r.seconds for r in rows)}
    for s, name in schemes.items():
        columns.append((name, "time", lambda r, s=s: f"{r.seconds[s]:.4g}"))
        columns.append((name, "idle", lambda r, s=s: f"{r.idle_fraction[s]:.1%}"))
    for s in schemes:
        if s != SPEEDUP_BASELINE:
            columns.append((SPEEDUP_OVER, SCHEMES[s], lambda r, s=s: f"{r.speedup(s):.3f}x"))
    columns.append(("limit", "time", lambda r: f"{r.limit_s:.4g}"))
    split = SPLIT_SCHEME in schemes
    if split:
        columns.append(("limit", "split", lambda r: f"{r.split_limit_s:.4g}"))
        columns.append(("limit", "work bound", lambda r: f"{r.work_bound_share:.0%}"))
    for s, name in schemes.items():
        columns.append(("over the limit", name, lambda r, s=s: f"{r.over_limit(s):+.1%}"))
    for k, name in (("lb_micro", "LB-Micro"), ("lb_mini", "LB-Mini")):
        columns.append(("balance efficiency", name, lambda r, k=k: f"{r.efficiency[k]:.4f}"))
    cells = [[cell(r) for _, _, cell in columns] for r in rows]
    widths = [max(len(head), 7, *(len(row[c]) for row in cells)) for c, (_, head, _) in enumerate(columns)]
    groups = [
        (g, [c for c, col in enumerate(columns) if col[0] == g]) for g in dict.fromkeys(col[0] for col in columns)
    ]

    def line(texts: list[str], align: str) -> str:
        return " | ".join(" ".join(f"{texts[c]:{align}{widths[c]}}" for c in cs) for _, cs in groups)

    group_line = " | ".join(f"{g:^{sum(widths[c] for c in cs) + len(cs) - 1}}" for g, cs in groups)
    lines = [group_line, line([head for _, head, _ in columns], ">"), "-" * len(group_line)]
    legend = (
        "limit: per mini-batch the larger of its work over the ranks' summed speeds and its longest sample "
        "on one rank, which no plan beats; over the limit: each scheme's time above it"
    )
    if split:
        legend += (
            f"\n{SCHEMES[SPLIT_SCHEME]}: LB-Mini with its longest samples split over Ulysses groups (all-to-alls "
            "modelled, not measured); its limit (split) is the larger of the work bound, the all-to-alls "
            "included, and the longest sample over the largest group the heads allow; work bound: the share of "
            "mini-batches whose split limit the work bound decided (the rest: the longest sample)"
        )
    return "\n".join(lines + [line(row, ">") for row in cells] + [legend])


def format_cluster_table(rows: Sequence[ClusterRow]) -> str:
    head = ["nodes", "GPUs", "mini-batch"]
    for name in CLUSTER_SCHEMES.values():
        head += [f"{name} s", "idle"]
    head += ["AR s", "flat comm/mb s", "pick"]
    cells = []
    for r in rows:
        row = [f"{r.nodes}", f"{r.nodes * r.gpus_per_node}", f"{r.minibatch_size}"]
        for s in CLUSTER_SCHEMES:
            row += [f"{r.seconds[s]:.4g}", f"{r.idle_fraction[s]:.1%}"]
        row += [f"{r.all_reduce_s:.3g}", f"{r.flat_comm_s:.3g}", CLUSTER_SCHEMES[r.pick]]
        cells.append(row)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = [" | ".join(f"{h:>{w}}" for h, w in zip(head, widths))]
    lines.append("-" * len(lines[0]))
    lines += [" | ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def plot(rows: Sequence[PlanRow], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_idle) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"fsdp_lb_micro": ":", "odc_lb_micro": "--", "odc_lb_mini": "-", SPLIT_SCHEME: "-."}
    schemes = {s: name for s, name in SCHEMES.items() if all(s in r.seconds for r in rows)}
    for i, size in enumerate(sorted({r.minibatch_size for r in rows})):
        sel = [r for r in rows if r.minibatch_size == size]
        dps = [r.dp_size for r in sel]
        for s, name in schemes.items():
            style = {"linestyle": styles[s], "marker": "o", "color": f"C{i}", "label": f"{name}, mini-batch {size}"}
            if s != SPEEDUP_BASELINE:
                ax_speed.plot(dps, [r.speedup(s) for r in sel], **style)
            ax_idle.plot(dps, [r.idle_fraction[s] for r in sel], **style)
    ranks = sorted({r.dp_size for r in rows})
    for ax, label in ((ax_speed, SPEEDUP_OVER), (ax_idle, "idle fraction")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.minorticks_off()
        ax.set_xlabel("data-parallel ranks")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_idle.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_cluster(
    rows: Sequence[ClusterRow],
    cluster: ClusterModel,
    *,
    lengths: str,
    cost: str,
    draws: int,
    max_token_len: int,
    throughput: float,
    as_json: bool = False,
) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "lengths": lengths,
                    "cost": cost,
                    "max_token_len": max_token_len,
                    "cluster": asdict(cluster),
                    "throughput": throughput,
                    "rows": [asdict(r) | {"pick": r.pick} for r in rows],
                }
            )
        )
        return
    print(
        f"lengths={lengths} cost={cost} max_token_len={max_token_len} draws={draws}; "
        f"time = cost / {throughput:g} per second"
    )
    print(
        f"{cluster.model_params / 1e9:.2f}B parameters (bf16 gathers, fp32 gradients); per GPU and direction: "
        f"{cluster.intra_node_bw / 1e9:g} GB/s inside a node, {cluster.inter_node_bw / 1e9:g} GB/s across nodes"
    )
    print(format_cluster_table(rows))
    print(
        "AR: ODC-HSDP's all-reduce across nodes per mini-batch; flat comm/mb: flat ODC's communication per "
        "micro-batch (NVSHMEM's host-driven progress not modelled: its best case); flat ODC across nodes is "
        "refused by this version, so it is shown, never picked"
    )
    picks = {r.pick for r in rows}
    if len(picks) == 1:
        pick = picks.pop()
        how = {"fsdp_hsdp": "strategy=fsdp2", "odc_hsdp": "strategy=odc"}[pick]
        print(
            f"pick: {CLUSTER_SCHEMES[pick]} on every row ({how} with fsdp_size = {cluster.gpus_per_node} GPUs per node)"
        )


# A forward-only pass (old and reference log-probs) costs about a third of an update's forward and backward.
FORWARD_SHARE = 1 / 3
ODC_SCHEME = "odc_lb_mini"


def step_times_of(lengths: str, source, modes: Sequence[str]) -> dict:
    """A run's steps as its trainer spent them (verl's timing_s/*) where `lengths` is its metrics file and
    they were logged; else empty. ValueError where they are and more than one mode is asked for."""
    from odc_plugin.balance.lengths import read_metrics
    from odc_plugin.balance.modes import StepTimes

    if not (lengths.endswith(".jsonl") and source.steps):
        return {}
    timed = {s: StepTimes.from_metrics(m) for s, m in read_metrics(lengths).items() if "timing_s/step" in m}
    if timed and len(modes) > 1:
        raise ValueError("--trainer-mode: a run's timings are of the one mode it ran in; give that mode")
    return timed


def end_to_end(
    modes: Sequence[str], rows: Sequence[PlanRow], timed: dict, source, draws: int, seed: int, decode
) -> str:
    """odc-plan's end-to-end lines: for each row, the step in each trainer mode under fsdp2 and under odc
    (the trainer's passes ODC+LB-Mini's speedup faster), from a run's own step times (`timed`,
    step_times_of) where there are some, else modelled with the DecodeModel `decode`."""
    from odc_plugin.balance.modes import predict_step

    out = []
    for row in rows:
        speedup = row.speedup(ODC_SCHEME)
        if timed:
            steps = {s: (predict_step(modes[0], t), predict_step(modes[0], t, speedup)) for s, t in timed.items()}
            ratios = sorted(b.step_s / o.step_s for b, o in steps.values())
            bound = sorted(o.bound for _, o in steps.values())
            median = ratios[len(ratios) // 2]
            out.append(
                f"{row.dp_size * row.sp} ranks, mini-batch {row.minibatch_size}: {modes[0]}, from the run's "
                f"timing_s/* ({len(steps)} steps): the passes {speedup:.3f}x (the planner), end to end {median:.3f}x "
                f"(median over steps; {bound.count('trainer')} of {len(bound)} steps bound by the trainer under odc)"
            )
            continue
        out.append(_modelled(modes, row, speedup, source, draws, seed, decode))
    return "end to end (" + ("from the run's timings" if timed else "MODELLED") + "):\n" + "\n".join(out)


def _modelled(modes, row: PlanRow, speedup: float, source, draws: int, seed: int, decode) -> str:
    """A step of one mini-batch: the rollout from the decode model over one inference server a GPU (each
    sequence decoded to its whole length), the passes the update and two forward-only passes; nothing else."""
    from odc_plugin.balance.modes import StepTimes, predict_step
    from odc_plugin.balance.rollout_time import rollout_seconds, steady_seconds

    gpus = row.dp_size * row.sp
    batches = [source.draw(row.minibatch_size, seed + d) for d in range(draws)]
    whole = sum(rollout_seconds([0] * len(b), b, decode, gpus).seconds for b in batches) / draws
    steady = sum(steady_seconds([0] * len(b), b, decode, gpus) for b in batches) / draws
    passes = row.seconds[SPEEDUP_BASELINE] * (1 + 2 * FORWARD_SHARE)
    lines = [
        f"{gpus} ranks, mini-batch {row.minibatch_size}: rollout {whole:.4g} s to its last response, {steady:.4g} s "
        f"never running dry; fsdp2's passes {passes:.4g} s, odc's {speedup:.3f}x faster"
    ]
    # the trainer waits for the whole rollout (sync), for a rollout that never runs dry (colocate_async), or
    # not at all, the rollout running beside it at that pace (separate_async)
    waits = {"sync": whole, "colocate_async": steady, "separate_async": 0.0}
    for mode in modes:
        times = StepTimes(waits[mode], passes, 0.0)
        period = steady if mode == "separate_async" else None
        base, odc = predict_step(mode, times, rollout_period_s=period), predict_step(mode, times, speedup, period)
        lines.append(
            f"  {mode}: step {base.step_s:.4g} -> {odc.step_s:.4g} s, end to end {odc.speedup(base):.3f}x "
            f"(bound by the {odc.bound})"
        )
    return "\n".join(lines)
