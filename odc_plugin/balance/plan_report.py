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
