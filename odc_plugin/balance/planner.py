"""Predict mini-batch time and idle under FSDP+LB-Micro, ODC+LB-Micro and ODC+LB-Mini (`odc-plan`).

FSDP's per-layer collectives make ranks move in lockstep: every micro-batch step lasts as long as its
slowest rank. Under ODC a rank only waits at the end of the mini-batch, so a mini-batch lasts as long
as the slowest rank's own sum. Work outside the micro-batch loop (optimizer step, final gradient
reduction) is the same in all three and left out.

    odc-plan --lengths rl --cost flops --model Qwen2.5-7B
    odc-plan --lengths data.parquet:num_tokens --ranks 16 32 --minibatch-sizes 512 --json
    odc-plan --cost fit --fit-file configs/cost_fit/Qwen2.5-7B-H100.json
    odc-plan --sp 2 4 --lengths rl --max-response-length 32768 --ranks 8 32

With Ulysses sequence parallelism (`--sp N`, verl's `ulysses_sequence_parallel_size`) the unit that
FSDP holds in lockstep and LB-Mini balances is a group of N GPUs: ranks / N groups, each computing its
samples N times as fast (heads split over the group; the all-to-all is not modelled), each packing
micro-batches to N times the per-GPU token budget, as verl does.

Across nodes (`--nodes`), it compares the three ways to run data parallelism over several nodes and
picks the fastest: FSDP2's HSDP with LB-Micro (verl's `fsdp2` with `fsdp_size` = GPUs per node), ODC
inside each node with one all-reduce across nodes per mini-batch (`odc` with the same `fsdp_size`), and
flat ODC over all ranks through NVSHMEM (`odc`, `fsdp_size=-1`):

    odc-plan --nodes 2 4 8 --lengths rl --model Qwen2.5-7B
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from odc_plugin.balance.common import RankPlan, balance_efficiency
from odc_plugin.balance.costs import PRESETS, CostCalibration, CostModel, FitCost, FlopsCost, get_cost_model
from odc_plugin.balance.lb_micro import lb_micro
from odc_plugin.balance.lb_mini import lb_mini
from odc_plugin.balance.lengths import load_lengths, rl_math_like, sft_long_context_like

SCHEMES = {"fsdp_lb_micro": "FSDP+LB-Micro", "odc_lb_micro": "ODC+LB-Micro", "odc_lb_mini": "ODC+LB-Mini"}

# Per GPU and direction, what collectives reach on H100 nodes: NVLink 4 carries 450 GB/s each way, of
# which NCCL reaches about 80%; one 400 Gb/s (NDR) InfiniBand NIC per GPU carries 50 GB/s, again ~80%.
NVLINK_BW = 360e9
IB_BW = 40e9


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
    intra_node_bw: float = NVLINK_BW
    inter_node_bw: float = IB_BW
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
    plan: RankPlan,
    costs: Sequence[float],
    *,
    lockstep: bool,
    model: StepTimeModel = StepTimeModel(),
    comm_s: float | None = None,
    slowdown: Sequence[float] | None = None,
) -> MiniBatchTime:
    """Time of one mini-batch run as `plan` (per rank, micro-batches of sample indices into costs);
    `comm_s`, when given, is each micro-batch's communication instead of the model's; `slowdown[r]`
    multiplies rank r's compute (a slower GPU). Idle is measured against each rank's own busy time."""
    comm = model.comm_seconds(len(plan)) if comm_s is None else comm_s
    slowdown = [1.0] * len(plan) if slowdown is None else list(slowdown)
    if len(slowdown) != len(plan):
        raise ValueError(f"slowdown has {len(slowdown)} entries for {len(plan)} ranks")
    compute = [[sum(costs[i] for i in mb) * f / model.throughput for mb in rank] for rank, f in zip(plan, slowdown)]
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
    mini = lb_mini(seqlens, dp_size, max_token_len, cost=cost, baseline=micro)
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

    dp_size: int  # data-parallel units: GPUs, or sequence-parallel groups of `sp` GPUs
    minibatch_size: int
    seconds: dict[str, float]
    idle_fraction: dict[str, float]
    efficiency: dict[str, float]
    sp: int = 1

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
    sp_sizes: Sequence[int] = (1,),
) -> list[PlanRow]:
    """One row per (ranks, sequence-parallel size, mini-batch size) that divides evenly, as verl requires;
    `ranks` are GPUs; `draw(n, seed)` gives the lengths of one mini-batch of n samples. Every row sees the
    same draws."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    rows = []
    for gpus in ranks:
        for sp in sp_sizes:
            if sp < 1 or gpus % sp:
                continue
            dp, group_model = gpus // sp, replace(model, throughput=model.throughput * sp)
            for size in minibatch_sizes:
                if size % dp:
                    continue
                runs = [
                    compare_schemes(draw(size, seed + d), dp, max_token_len * sp, cost, group_model)
                    for d in range(draws)
                ]
                rows.append(
                    PlanRow(
                        dp,
                        size,
                        seconds={s: statistics.fmean(r.times[s].seconds for r in runs) for s in SCHEMES},
                        idle_fraction={s: statistics.fmean(r.times[s].idle_fraction for r in runs) for s in SCHEMES},
                        efficiency={k: statistics.fmean(r.efficiency[k] for r in runs) for k in runs[0].efficiency},
                        sp=sp,
                    )
                )
    return rows


def format_table(rows: Sequence[PlanRow]) -> str:
    columns = [  # (group, header, cell of a row)
        ("", "ranks", lambda r: f"{r.dp_size * r.sp}"),
        ("", "mini-batch", lambda r: f"{r.minibatch_size}"),
        ("", "per rank", lambda r: f"{r.minibatch_size // r.dp_size}"),
    ]
    if any(r.sp > 1 for r in rows):  # "per rank" is then per sequence-parallel group
        columns.insert(1, ("", "sp", lambda r: f"{r.sp}"))
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


CLUSTER_SCHEMES = {"fsdp_hsdp": "FSDP-HSDP+LB-Micro", "odc_hsdp": "ODC-HSDP+LB-Mini", "odc_flat": "flat ODC+LB-Mini"}
# Qwen2.5 models whose config.json ties the LM head to the input embedding.
TIED_EMBEDDINGS = {"Qwen2.5-0.5B", "Qwen2.5-1.5B"}


def model_params(preset: str) -> int:
    """Parameters of a preset: its weight matrices (as FlopsCost counts them, head included; an MoE's every
    expert, all of which are communicated) plus the input embedding when the head is not tied to it."""
    cost = FlopsCost.from_config(preset).dense()
    embedding = 0 if preset in TIED_EMBEDDINGS else cost.vocab_size * cost.hidden_size
    return cost.linear_flops_per_token // 2 + embedding


@dataclass(frozen=True)
class ClusterModel:
    """Communication of data parallelism over `gpus_per_node`-GPU nodes, per GPU.

    Every micro-batch gathers each parameter twice (forward and backward, bf16: `param_bytes`) and
    reduces its gradient once (fp32: `grad_bytes`); a rank moves the part it does not hold, and both
    FSDP and ODC overlap it with compute (a micro-batch lasts max(compute, communication)).

    - fsdp_hsdp: shards inside a node; every backward also all-reduces each gradient shard across the
      nodes (verl's default, use_no_sync_for_gradient_accumulation=False), on its own links, overlapped.
    - odc_hsdp: shards inside a node; one all-reduce of the gradient shard across nodes after the
      mini-batch, not overlapped.
    - odc_flat: shards over every rank; (G - 1) / dp of the bytes over NVLink, (dp - G) / dp over the
      network, concurrently. NVSHMEM's host-driven accumulate (it folds only while the owner calls the
      transport) is not modelled, so this is flat ODC's best case.
    """

    model_params: float
    gpus_per_node: int = 8
    intra_node_bw: float = NVLINK_BW
    inter_node_bw: float = IB_BW
    param_bytes: int = 2
    grad_bytes: int = 4

    def __post_init__(self):
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"ClusterModel.{f.name} must be > 0, got {getattr(self, f.name)}")

    def micro_batch_comm(self, scheme: str, nodes: int) -> float:
        g, dp = self.gpus_per_node, nodes * self.gpus_per_node
        moved = self.model_params * (2 * self.param_bytes + self.grad_bytes)
        if scheme == "odc_flat":
            return moved * max((g - 1) / dp / self.intra_node_bw, (dp - g) / dp / self.inter_node_bw)
        intra = moved * (g - 1) / g / self.intra_node_bw
        return max(intra, self.all_reduce_seconds(nodes)) if scheme == "fsdp_hsdp" else intra

    def all_reduce_seconds(self, nodes: int) -> float:
        """A ring all-reduce of one rank's fp32 gradient shard (1/G of the model) across the nodes."""
        shard = self.model_params * self.grad_bytes / self.gpus_per_node
        return 2 * (nodes - 1) / nodes * shard / self.inter_node_bw

    def end_seconds(self, scheme: str, nodes: int) -> float:
        return self.all_reduce_seconds(nodes) if scheme == "odc_hsdp" else 0.0


@dataclass
class ClusterRow:
    """Means over the draws of one (nodes, mini-batch size) configuration."""

    nodes: int
    gpus_per_node: int
    minibatch_size: int
    seconds: dict[str, float]
    idle_fraction: dict[str, float]
    all_reduce_s: float  # ODC-HSDP's end-of-mini-batch all-reduce
    flat_comm_s: float  # flat ODC's communication per micro-batch

    @property
    def pick(self) -> str:
        return min(CLUSTER_SCHEMES, key=self.seconds.__getitem__)


def compare_cluster(
    seqlens: Sequence[int], nodes: int, max_token_len: int, cost: CostModel, cluster: ClusterModel, throughput: float
) -> dict[str, MiniBatchTime]:
    """One mini-batch over nodes x gpus_per_node ranks, LB-Micro for FSDP and LB-Mini over every rank for ODC."""
    dp = nodes * cluster.gpus_per_node
    costs = cost.costs(seqlens)
    micro = lb_micro(seqlens, dp, max_token_len)
    mini = lb_mini(seqlens, dp, max_token_len, cost=cost, baseline=micro)
    compute = StepTimeModel(throughput=throughput)
    times = {}
    for scheme, plan, lockstep in (("fsdp_hsdp", micro, True), ("odc_hsdp", mini, False), ("odc_flat", mini, False)):
        t = simulate_minibatch(
            plan, costs, lockstep=lockstep, model=compute, comm_s=cluster.micro_batch_comm(scheme, nodes)
        )
        seconds = t.seconds + cluster.end_seconds(scheme, nodes)
        times[scheme] = MiniBatchTime(seconds, 1 - (1 - t.idle_fraction) * t.seconds / seconds)
    return times


def cluster_table(
    draw: Callable[[int, int], list[int]],
    nodes: Sequence[int],
    minibatch_sizes: Sequence[int],
    max_token_len: int,
    cost: CostModel,
    cluster: ClusterModel,
    throughput: float,
    draws: int = 5,
    seed: int = 0,
) -> list[ClusterRow]:
    """One row per (nodes, mini-batch size) whose size divides over the ranks; every node count sees the
    same draws."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    rows = []
    for n in nodes:
        if n < 2:
            raise ValueError(f"--nodes compares multi-node set-ups; got {n} node(s)")
        for size in minibatch_sizes:
            if size % (n * cluster.gpus_per_node):
                continue
            runs = [
                compare_cluster(draw(size, seed + d), n, max_token_len, cost, cluster, throughput) for d in range(draws)
            ]
            rows.append(
                ClusterRow(
                    n,
                    cluster.gpus_per_node,
                    size,
                    seconds={s: statistics.fmean(r[s].seconds for r in runs) for s in CLUSTER_SCHEMES},
                    idle_fraction={s: statistics.fmean(r[s].idle_fraction for r in runs) for s in CLUSTER_SCHEMES},
                    all_reduce_s=cluster.all_reduce_seconds(n),
                    flat_comm_s=cluster.micro_batch_comm("odc_flat", n),
                )
            )
    return rows


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
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64], help="GPUs")
    p.add_argument(
        "--sp",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="Ulysses sequence-parallel sizes (ulysses_sequence_parallel_size); rows per size",
    )
    p.add_argument("--minibatch-sizes", type=int, nargs="+", default=[256, 512, 1024], help="samples per mini-batch")
    p.add_argument("--max-token-len", type=int, help="ppo_max_token_len_per_gpu; default max(16384, longest)")
    p.add_argument("--cost", default="flops", choices=["tokens", "flops", "fit"])
    p.add_argument("--model", default="Qwen2.5-7B", choices=list(PRESETS), help="for --cost flops")
    p.add_argument(
        "--moe-flops",
        choices=["active", "total"],
        default="active",
        help="for --cost flops with an MoE model: a token's cost through its own experts (active, "
        "what it costs) or through all of them (total, as a dense model of that size)",
    )
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
    p.add_argument(
        "--intra-node-bw",
        type=float,
        default=NVLINK_BW,
        help="bytes/s per GPU and direction inside a node (default: ~80%% of H100 NVLink 4)",
    )
    p.add_argument(
        "--inter-node-bw",
        type=float,
        default=IB_BW,
        help="bytes/s per GPU and direction across nodes (default: ~80%% of one 400 Gb/s IB NIC)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        help="compare FSDP-HSDP, ODC-HSDP and flat ODC on these node counts (instead of --ranks)",
    )
    p.add_argument("--model-params", type=float, help="for --nodes: parameters to communicate; default --model's")
    p.add_argument("--max-prompt-length", type=int, default=512, help="for --lengths rl")
    p.add_argument("--max-response-length", type=int, default=4096, help="for --lengths rl")
    p.add_argument("--max-length", type=int, default=32768, help="for --lengths sft")
    p.add_argument("--draws", type=int, default=5, help="mini-batches averaged per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also plot speedup and idle fraction")
    args = p.parse_args(argv)
    if args.plot and len(args.sp) > 1:
        p.error("--plot draws one sequence-parallel size; give one --sp")
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
            if args.moe_flops == "total" and isinstance(cost, FlopsCost):
                cost = cost.dense()
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
        if args.nodes:
            cluster = ClusterModel(
                args.model_params or model_params(args.model),
                args.gpus_per_node,
                args.intra_node_bw,
                args.inter_node_bw,
            )
            rows = cluster_table(
                draw,
                args.nodes,
                args.minibatch_sizes,
                max_token_len,
                cost,
                cluster,
                model.throughput,
                args.draws,
                args.seed,
            )
        else:
            if any(sp < 1 for sp in args.sp):
                raise ValueError(f"--sp sizes must be >= 1, got {args.sp}")
            rows = plan_table(
                draw, args.ranks, args.minibatch_sizes, max_token_len, cost, model, args.draws, args.seed, args.sp
            )
    except ValueError as e:
        p.error(str(e))
    if args.nodes:
        _print_cluster(args, rows, cluster, max_token_len, model.throughput)
        return
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
        if any(sp > 1 for sp in args.sp):
            print(
                "sp: Ulysses group size; 'per rank' is then per group, whose micro-batches hold sp x "
                "max_token_len tokens"
            )
        print(format_table(rows))
    if args.plot:
        plot(rows, args.plot, title=f"{args.lengths}, cost={args.cost}, max_token_len={max_token_len}")


def _print_cluster(
    args, rows: Sequence[ClusterRow], cluster: ClusterModel, max_token_len: int, throughput: float
) -> None:
    if args.json:
        print(
            json.dumps(
                {
                    "lengths": args.lengths,
                    "cost": args.cost,
                    "max_token_len": max_token_len,
                    "cluster": asdict(cluster),
                    "throughput": throughput,
                    "rows": [asdict(r) | {"pick": r.pick} for r in rows],
                }
            )
        )
        return
    print(
        f"lengths={args.lengths} cost={args.cost} max_token_len={max_token_len} draws={args.draws}; "
        f"time = cost / {throughput:g} per second"
    )
    print(
        f"{cluster.model_params / 1e9:.2f}B parameters (bf16 gathers, fp32 gradients); per GPU and direction: "
        f"{cluster.intra_node_bw / 1e9:g} GB/s inside a node, {cluster.inter_node_bw / 1e9:g} GB/s across nodes"
    )
    print(format_cluster_table(rows))
    print(
        "AR: ODC-HSDP's all-reduce across nodes per mini-batch; flat comm/mb: flat ODC's communication per "
        "micro-batch (NVSHMEM's host-driven progress not modelled: its best case)"
    )
    picks = {r.pick for r in rows}
    if len(picks) == 1:
        pick = picks.pop()
        how = {
            "fsdp_hsdp": "strategy=fsdp2 with fsdp_size",
            "odc_hsdp": "strategy=odc with fsdp_size",
            "odc_flat": "strategy=odc with fsdp_size=-1 over",
        }[pick]
        print(
            f"pick: {CLUSTER_SCHEMES[pick]} on every row ({how} = {cluster.gpus_per_node} GPUs per node)"
            if pick != "odc_flat"
            else f"pick: {CLUSTER_SCHEMES[pick]} on every row ({how} NVSHMEM)"
        )


if __name__ == "__main__":
    main()
