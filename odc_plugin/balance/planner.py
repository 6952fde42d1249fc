"""Predict mini-batch time and idle under FSDP+LB-Micro, ODC+LB-Micro and ODC+LB-Mini (`odc-plan`).

FSDP's per-layer collectives make ranks move in lockstep: every micro-batch step lasts as long as its
slowest rank. Under ODC a rank only waits at the end of the mini-batch, so a mini-batch lasts as long
as the slowest rank's own sum. Work outside the micro-batch loop (optimizer step, final gradient
reduction) is the same in all three and left out.

    odc-plan --lengths rl --cost flops --model Qwen2.5-7B
    odc-plan --lengths data.parquet:num_tokens --ranks 16 32 --minibatch-sizes 512 --json
    odc-plan --cost fit --fit-file configs/cost_fit/Qwen2.5-7B-H100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from odc_plugin.balance.common import RankPlan, balance_efficiency
from odc_plugin.balance.costs import QWEN2_5_PRESETS, CostCalibration, CostModel, FitCost, get_cost_model
from odc_plugin.balance.lb_micro import lb_micro
from odc_plugin.balance.lb_mini import lb_mini
from odc_plugin.balance.lengths import load_lengths, rl_math_like, sft_long_context_like

SCHEMES = {"fsdp_lb_micro": "FSDP+LB-Micro", "odc_lb_micro": "ODC+LB-Micro", "odc_lb_mini": "ODC+LB-Mini"}


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one micro-batch on one rank: max(compute, parameter communication), since both FSDP and
    ODC prefetch the next layer's parameters while computing the current one.

    throughput is cost units per second (FLOP/s for the flops cost; 1 for a fit in seconds).
    layer_comm_bytes is what a full layer moves per micro-batch (gathered parameters in forward and
    backward, plus gradients); each rank moves the (dp - 1) / dp it does not hold, over NVLink inside
    a node and over the network beyond one. 0 models compute only.
    """

    throughput: float = 1.0
    layer_comm_bytes: float = 0.0
    num_layers: int = 0
    intra_node_bw: float = 200e9
    inter_node_bw: float = 25e9
    gpus_per_node: int = 8

    def __post_init__(self):
        for name in ("throughput", "intra_node_bw", "inter_node_bw", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StepTimeModel.{name} must be > 0, got {getattr(self, name)}")
        if self.layer_comm_bytes < 0 or self.num_layers < 0:
            raise ValueError("StepTimeModel.layer_comm_bytes and num_layers must be >= 0")
        if self.layer_comm_bytes and not self.num_layers:
            raise ValueError("StepTimeModel.layer_comm_bytes needs num_layers")

    def comm_seconds(self, dp_size: int) -> float:
        bw = self.intra_node_bw if dp_size <= self.gpus_per_node else self.inter_node_bw
        return self.num_layers * self.layer_comm_bytes * (dp_size - 1) / dp_size / bw


@dataclass(frozen=True)
class MiniBatchTime:
    seconds: float
    idle_fraction: float  # share of rank-seconds in the mini-batch not spent computing


def simulate_minibatch(
    plan: RankPlan, costs: Sequence[float], *, lockstep: bool, model: StepTimeModel = StepTimeModel()
) -> MiniBatchTime:
    """Time of one mini-batch run as `plan` (per rank, micro-batches of sample indices into costs)."""
    comm = model.comm_seconds(len(plan))
    compute = [[sum(costs[i] for i in mb) / model.throughput for mb in rank] for rank in plan]
    if lockstep:
        counts = sorted({len(rank) for rank in compute})
        if len(counts) > 1:
            raise ValueError(f"lockstep ranks need equal micro-batch counts, got counts {counts}")
        seconds = sum(max(*step, comm) for step in zip(*compute))
    else:
        seconds = max(sum(max(c, comm) for c in rank) for rank in compute)
    busy = sum(map(sum, compute))
    return MiniBatchTime(seconds, 1 - busy / (len(plan) * seconds) if seconds else 0.0)


@dataclass(frozen=True)
class Comparison:
    times: dict[str, MiniBatchTime]  # per scheme
    efficiency: dict[str, float]  # balance_efficiency of the LB-Micro and LB-Mini rank totals, by the same cost


def compare_schemes(
    seqlens: Sequence[int],
    dp_size: int,
    max_token_len: int,
    cost: str | CostModel = "tokens",
    model: StepTimeModel = StepTimeModel(),
) -> Comparison:
    """Plan one mini-batch with LB-Micro and LB-Mini and time it under the three schemes."""
    cost = get_cost_model(cost)
    costs = cost.costs(seqlens)
    micro = lb_micro(seqlens, dp_size, max_token_len)
    mini = lb_mini(seqlens, dp_size, max_token_len, cost=cost)
    return Comparison(
        times={
            "fsdp_lb_micro": simulate_minibatch(micro, costs, lockstep=True, model=model),
            "odc_lb_micro": simulate_minibatch(micro, costs, lockstep=False, model=model),
            "odc_lb_mini": simulate_minibatch(mini, costs, lockstep=False, model=model),
        },
        efficiency={"lb_micro": balance_efficiency(micro, costs), "lb_mini": balance_efficiency(mini, costs)},
    )


@dataclass
class PlanRow:
    """Means over the draws of one (ranks, mini-batch size) configuration."""

    dp_size: int
    minibatch_size: int
    seconds: dict[str, float]
    idle_fraction: dict[str, float]
    efficiency: dict[str, float]

    def speedup(self, scheme: str) -> float:
        return self.seconds["fsdp_lb_micro"] / self.seconds[scheme]


def plan_table(
    draw: Callable[[int, int], list[int]],
    ranks: Sequence[int],
    minibatch_sizes: Sequence[int],
    max_token_len: int,
    cost: str | CostModel = "tokens",
    model: StepTimeModel = StepTimeModel(),
    draws: int = 5,
    seed: int = 0,
) -> list[PlanRow]:
    """One row per (ranks, mini-batch size) that divides evenly, as verl requires; `draw(n, seed)`
    gives the lengths of one mini-batch of n samples. Every rank count sees the same draws."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    rows = []
    for dp in ranks:
        for size in minibatch_sizes:
            if size % dp:
                continue
            runs = [compare_schemes(draw(size, seed + d), dp, max_token_len, cost, model) for d in range(draws)]
            rows.append(
                PlanRow(
                    dp,
                    size,
                    seconds={s: statistics.fmean(r.times[s].seconds for r in runs) for s in SCHEMES},
                    idle_fraction={s: statistics.fmean(r.times[s].idle_fraction for r in runs) for s in SCHEMES},
                    efficiency={k: statistics.fmean(r.efficiency[k] for r in runs) for k in runs[0].efficiency},
                )
            )
    return rows


def format_table(rows: Sequence[PlanRow]) -> str:
    columns = [  # (group, header, cell of a row)
        ("", "ranks", lambda r: f"{r.dp_size}"),
        ("", "mini-batch", lambda r: f"{r.minibatch_size}"),
        ("", "per rank", lambda r: f"{r.minibatch_size // r.dp_size}"),
    ]
    for s, name in SCHEMES.items():
        columns.append((name, "time", lambda r, s=s: f"{r.seconds[s]:.4g}"))
        columns.append((name, "idle", lambda r, s=s: f"{r.idle_fraction[s]:.1%}"))
    for s in ("odc_lb_micro", "odc_lb_mini"):
        columns.append(("speedup", SCHEMES[s], lambda r, s=s: f"{r.speedup(s):.3f}x"))
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
    return "\n".join(lines + [line(row, ">") for row in cells])


def plot(rows: Sequence[PlanRow], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_idle) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"fsdp_lb_micro": ":", "odc_lb_micro": "--", "odc_lb_mini": "-"}
    for i, size in enumerate(sorted({r.minibatch_size for r in rows})):
        sel = [r for r in rows if r.minibatch_size == size]
        dps = [r.dp_size for r in sel]
        for s, name in SCHEMES.items():
            style = {"linestyle": styles[s], "marker": "o", "color": f"C{i}", "label": f"{name}, mini-batch {size}"}
            if s != "fsdp_lb_micro":
                ax_speed.plot(dps, [r.speedup(s) for r in sel], **style)
            ax_idle.plot(dps, [r.idle_fraction[s] for r in sel], **style)
    ranks = sorted({r.dp_size for r in rows})
    for ax, label in ((ax_speed, "speedup over FSDP+LB-Micro"), (ax_idle, "idle fraction")):
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


def length_source(
    spec: str, *, max_prompt_length: int = 512, max_response_length: int = 4096, max_length: int = 32768
) -> tuple[Callable[[int, int], list[int]], int]:
    """`draw(n, seed)` for "rl", "sft" or a load_lengths spec (sampled with replacement), and the longest
    length it can return."""
    if spec == "rl":

        def draw(n, seed):
            sample = rl_math_like(
                n, max_prompt_length=max_prompt_length, max_response_length=max_response_length, seed=seed
            )
            return sample.total

        return draw, max_prompt_length + max_response_length
    if spec == "sft":
        return (lambda n, seed: sft_long_context_like(n, max_length=max_length, seed=seed).total), max_length
    lengths = np.asarray(load_lengths(spec))
    return (lambda n, seed: np.random.default_rng(seed).choice(lengths, n).tolist()), int(lengths.max())


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="odc-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", default="rl", help="rl, sft, or FILE.json / FILE.txt / FILE.parquet:COLUMN")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--minibatch-sizes", type=int, nargs="+", default=[256, 512, 1024], help="samples per mini-batch")
    p.add_argument("--max-token-len", type=int, help="ppo_max_token_len_per_gpu; default max(16384, longest)")
    p.add_argument("--cost", default="flops", choices=["tokens", "flops", "fit"])
    p.add_argument("--model", default="Qwen2.5-7B", choices=list(QWEN2_5_PRESETS), help="for --cost flops")
    p.add_argument("--fit-a", type=float, help="for --cost fit: a in a*s^2 + b*s")
    p.add_argument("--fit-b", type=float, help="for --cost fit: b in a*s^2 + b*s")
    p.add_argument(
        "--fit-file",
        metavar="FILE.json",
        help="for --cost fit, instead of --fit-a/--fit-b: benchmarks/calibrate_cost.py's per-layer fit, "
        "times --num-layers (default: the layers of the file's model)",
    )
    p.add_argument(
        "--throughput", type=float, help="cost units per second; default 4e14 for flops (H100, ~40%% MFU), else 1"
    )
    p.add_argument("--layer-comm-bytes", type=float, default=0.0, help="per layer and micro-batch; 0: compute only")
    p.add_argument("--num-layers", type=int, help="default: the model's for --cost flops and --fit-file")
    p.add_argument("--intra-node-bw", type=float, default=200e9, help="bytes/s per GPU inside a node")
    p.add_argument("--inter-node-bw", type=float, default=25e9, help="bytes/s per GPU across nodes")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--max-prompt-length", type=int, default=512, help="for --lengths rl")
    p.add_argument("--max-response-length", type=int, default=4096, help="for --lengths rl")
    p.add_argument("--max-length", type=int, default=32768, help="for --lengths sft")
    p.add_argument("--draws", type=int, default=5, help="mini-batches averaged per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also plot speedup and idle fraction")
    args = p.parse_args(argv)
    if args.cost == "fit" and args.fit_file and (args.fit_a is not None or args.fit_b is not None):
        p.error("--cost fit takes --fit-file or --fit-a and --fit-b, not both")
    if args.cost == "fit" and not args.fit_file and (args.fit_a is None or args.fit_b is None):
        p.error("--cost fit needs --fit-file, or --fit-a and --fit-b")
    num_layers = args.num_layers
    try:
        if args.cost == "fit" and args.fit_file:
            calibration = CostCalibration.load(args.fit_file)
            num_layers = num_layers or calibration.num_hidden_layers
            if not num_layers:
                raise ValueError(f"{args.fit_file}: model {calibration.model!r} is not a preset; give --num-layers")
            # Whole-model seconds per sequence, as --fit-a/--fit-b give them, so the throughput stays 1.
            cost = FitCost(calibration.a * num_layers, calibration.b * num_layers)
        else:
            cost = get_cost_model(
                args.cost,
                **{"flops": {"model": args.model}, "fit": {"a": args.fit_a, "b": args.fit_b}}.get(args.cost, {}),
            )
        model = StepTimeModel(
            throughput=args.throughput or (4e14 if args.cost == "flops" else 1.0),
            layer_comm_bytes=args.layer_comm_bytes,
            num_layers=num_layers or getattr(cost, "num_hidden_layers", 0),
            intra_node_bw=args.intra_node_bw,
            inter_node_bw=args.inter_node_bw,
            gpus_per_node=args.gpus_per_node,
        )
        draw, longest = length_source(
            args.lengths,
            max_prompt_length=args.max_prompt_length,
            max_response_length=args.max_response_length,
            max_length=args.max_length,
        )
        max_token_len = args.max_token_len or max(16384, longest)
        rows = plan_table(draw, args.ranks, args.minibatch_sizes, max_token_len, cost, model, args.draws, args.seed)
    except ValueError as e:
        p.error(str(e))
    if not rows:
        p.error("no mini-batch size divides evenly over any rank count")
    if args.json:
        rows_json = [asdict(r) | {"speedup": {s: r.speedup(s) for s in SCHEMES}} for r in rows]
        print(
            json.dumps({"lengths": args.lengths, "cost": args.cost, "max_token_len": max_token_len, "rows": rows_json})
        )
    else:
        print(
            f"lengths={args.lengths} cost={args.cost} max_token_len={max_token_len} draws={args.draws}; "
            f"time = cost / {model.throughput:g} per second"
        )
        print(format_table(rows))
    if args.plot:
        plot(rows, args.plot, title=f"{args.lengths}, cost={args.cost}, max_token_len={max_token_len}")


if __name__ == "__main__":
    main()
