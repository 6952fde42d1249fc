"""`odc-spes`: SPES against centralized data parallelism and full-model averaging, on CPU node processes.

N processes, one per node, train the same tiny OLMoE byte-level language model (transformers' own MoE
classes) on the Python standard library's sources, once per mode, from the same weights, on the same
batches (node p's batch at step t is the same in every mode). Every `sync_every` steps the held-out
loss is measured (after the sync, when every node holds the same model). Prints a table, writes a JSON
report and a PNG of held-out loss against steps and against bytes communicated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..launch import run_ranks
from .config import MODES, OUTER_OPTIMIZERS, OuterKind, SPESConfig
from .corpus import random_windows, spread_windows, stdlib_corpus
from .experts import assign_experts, moe_layers, prepare_experts, trainable_parameters
from .layout import node_layout
from .memory import state_bytes
from .models import MOE_SIZES, build_olmoe, lm_loss
from .sync import NodeSync


@dataclass
class SPESDemoConfig:
    nodes: int = 4
    """Node processes, one rank each; they share the experts evenly."""
    steps: int = 120
    """Optimizer steps of every mode, a multiple of `sync_every`."""
    sync_every: int = 10
    """Local steps between syncs in spes and fedavg."""
    outer_optimizer: OuterKind = "none"
    """The step every sync takes along the synced change, in spes and fedavg alike (SPESConfig)."""
    outer_lr: float = 0.7
    """The outer step's learning rate."""
    outer_momentum: float = 0.9
    """The outer step's Nesterov momentum."""
    model_size: str = "tiny"
    """A key of models.MOE_SIZES."""
    batch_size: int = 8
    """Sequences per node per step."""
    seq_len: int = 128
    """Bytes per sequence."""
    lr: float = 3e-3
    """AdamW's peak learning rate (warm-up, then cosine to a tenth)."""
    heldout_sequences: int = 64
    """Held-out windows, spread over the held-out files."""
    seed: int = 0
    """The initial weights and every node's batches."""
    out_dir: str = "odc_reports"
    """Where odc_spes.json and odc_spes.png go."""

    def __post_init__(self):
        for key in ("nodes", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.sync_every < 1 or self.steps < 1 or self.steps % self.sync_every:
            raise ValueError(
                f"--steps must be a positive multiple of the sync period {self.sync_every}, got {self.steps}"
            )
        if self.model_size not in MOE_SIZES:
            raise ValueError(f"model_size must be one of {', '.join(MOE_SIZES)}, got '{self.model_size}'")
        try:
            assign_experts(MOE_SIZES[self.model_size].num_experts, self.nodes, 0)
        except ValueError as e:
            raise ValueError(f"--nodes {self.nodes}: {e}") from None
        try:
            self.spes_config("spes")
        except ValueError as e:  # name the option as typed: "outer_lr must..." -> "--outer-lr must..."
            key, rest = str(e).split(" ", 1)
            raise ValueError(f"--{key.replace('_', '-')} {rest}") from None

    def spes_config(self, mode: str) -> SPESConfig:
        """The reference's merging knobs, its step counts scaled to this short run: the reference syncs
        every 100 steps, merges every 5th sync and decays alpha over 40% of its 50k steps; a run of a
        dozen syncs merges every 2nd sync and decays over half the run, so that merging happens at all.
        Donors: a quarter of a layer's experts (the reference's 4 of 16)."""
        experts = MOE_SIZES[self.model_size].num_experts
        return SPESConfig(
            mode=mode,
            sync_every=self.sync_every,
            outer_optimizer=self.outer_optimizer,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            merge_interval=2 * self.sync_every,
            merge_alpha_start=0.05,
            merge_decay_steps=max(1, self.steps // 2),
            merge_topk=max(1, experts // 4),
            sync_timeout_s=300.0,
        )


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over 10% of the run, then cosine down to 10% (the reference's schedule shape)."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor) -> float:
    """Mean next-byte cross-entropy over every node's share of the held-out windows."""
    total = torch.zeros(2, dtype=torch.float64)
    for chunk in windows.split(8):
        total[0] += lm_loss(model, chunk, aux=False).item() * chunk.numel()
        total[1] += chunk.numel()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def train_mode(cfg: SPESDemoConfig, mode: str, layout, corpus, heldout: torch.Tensor) -> dict:
    config = cfg.spes_config(mode)
    model = build_olmoe(cfg.model_size, seed=cfg.seed)
    prepare_experts(model, config, layout.num_nodes, layout.node)
    sync = NodeSync(model, layout, config)
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.steps))
    evals = [(0, heldout_loss(model, heldout), 0)]
    dist.barrier()
    train_s, start = 0.0, time.perf_counter()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + layout.node)
        lm_loss(model, random_windows(corpus.train, cfg.batch_size, cfg.seq_len, g)).backward()
        sync.reduce_gradients(step)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step == 1:
            state = state_bytes(model, opt, sync.outer)
        opt.zero_grad(set_to_none=True)
        sync.maybe_sync(step)
        train_s += time.perf_counter() - t0
        if step % cfg.sync_every == 0:
            sent, received = sync.total_bytes()
            evals.append((step, heldout_loss(model, heldout), sent + received))
    wall_s = time.perf_counter() - start
    syncs = [r for r in sync.records if r.kind == "sync"]
    return {
        "evals": evals,
        "state": asdict(state),
        "records": [asdict(r) for r in sync.records],
        "bytes_per_sync": (syncs[0].sent, syncs[0].received) if syncs else None,
        "bytes_per_step": (sync.records[0].sent, sync.records[0].received) if mode == "centralized" else None,
        "total_bytes": sync.total_bytes(),
        "comm_s": sum(r.seconds for r in sync.records),
        "train_s": train_s,
        "wall_s": wall_s,
        "merges": [(r.step, r.merge_alpha) for r in syncs if r.merge_alpha > 0],
    }


def node_body(rank, world, cfg: SPESDemoConfig) -> dict:
    layout = node_layout(1)
    corpus = stdlib_corpus()
    heldout = spread_windows(corpus.heldout, cfg.heldout_sequences, cfg.seq_len)[layout.node :: layout.num_nodes]
    return {mode: train_mode(cfg, mode, layout, corpus, heldout) for mode in MODES}


def describe(cfg: SPESDemoConfig) -> tuple[dict, dict]:
    """Parameter counts of the model and sizes of the corpus, for the report."""
    model = build_olmoe(cfg.model_size, seed=cfg.seed)
    prepare_experts(model, SPESConfig(mode="fedavg"), 1, 0)
    layers = moe_layers(model)
    expert = sum(p.numel() for layer in layers for e in range(layer.num_experts) for p in layer.expert_params(e))
    total = sum(p.numel() for p in model.parameters())
    corpus = stdlib_corpus()
    return (
        {
            "parameters": total,
            "expert_parameters": expert,
            "shared_parameters": total - expert,
            "layers": len(layers),
            "experts": layers[0].num_experts,
        },
        {
            "root": corpus.root,
            "train_files": corpus.train_files,
            "heldout_files": corpus.heldout_files,
            "train_bytes": len(corpus.train),
            "heldout_bytes": len(corpus.heldout),
        },
    )


def reference_round_ratio(shared: int, experts: int, nodes: int) -> float:
    """Bytes per node per round of the reference's parameter server, SPES over DiLoCo: a SPES node
    uploads the shared parameters and its own experts and downloads the whole model; a DiLoCo node
    uploads and downloads the whole model."""
    return (2 * shared + experts + experts / nodes) / (2 * (shared + experts))


def summarize(cfg: SPESDemoConfig, per_node: list[dict], wall_s: float) -> dict:
    model, corpus = describe(cfg)
    tokens_per_step = cfg.nodes * cfg.batch_size * cfg.seq_len
    modes = {}
    for mode in MODES:
        runs = [node[mode] for node in per_node]
        first = runs[0]
        modes[mode] = {
            "heldout_loss": [(step, loss) for step, loss, _ in first["evals"]],
            "bytes_communicated_per_node": [(step, b) for step, _, b in first["evals"]],
            "final_heldout_loss": first["evals"][-1][1],
            "tokens": cfg.steps * tokens_per_step,
            "trainable_state_bytes_per_node": [r["state"] for r in runs],
            "bytes_per_sync_per_node": [r["bytes_per_sync"] for r in runs],
            "bytes_per_step_per_node": [r["bytes_per_step"] for r in runs],
            "total_bytes_per_node": [r["total_bytes"] for r in runs],
            "syncs": sum(1 for r in first["records"] if r["kind"] == "sync"),
            "merges": first["merges"],
            "comm_s_max": max(r["comm_s"] for r in runs),
            "train_s_max": max(r["train_s"] for r in runs),
            "wall_s_max": max(r["wall_s"] for r in runs),
        }
    full = modes["centralized"]["trainable_state_bytes_per_node"][0]["counted"]
    for mode in MODES:
        states = modes[mode]["trainable_state_bytes_per_node"]
        modes[mode]["state_fraction_of_full"] = max(s["counted"] for s in states) / full
    spes_sync = sum(modes["spes"]["bytes_per_sync_per_node"][0])
    fedavg_sync = sum(modes["fedavg"]["bytes_per_sync_per_node"][0])
    shared, experts = 4 * model["shared_parameters"], 4 * model["expert_parameters"]
    gap = modes["spes"]["final_heldout_loss"] - modes["centralized"]["final_heldout_loss"]
    return {
        "config": asdict(cfg),
        "spes_config": asdict(cfg.spes_config("spes")),
        "model": model,
        "corpus": corpus,
        "modes": modes,
        "spes_minus_centralized_loss": gap,
        "spes_relative_to_centralized": gap / modes["centralized"]["final_heldout_loss"],
        "spes_over_fedavg_bytes_per_sync": spes_sync / fedavg_sync,
        "reference_protocol_spes_over_diloco_bytes_per_round": reference_round_ratio(shared, experts, cfg.nodes),
        "wall_s": wall_s,
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def print_report(report: dict) -> None:
    modes = report["modes"]
    print("\nheld-out loss (nats per byte) after each sync period:")
    print(f"{'step':>6}" + "".join(f"{m:>14}" for m in MODES))
    for i, (step, _) in enumerate(modes["spes"]["heldout_loss"]):
        print(f"{step:>6}" + "".join(f"{modes[m]['heldout_loss'][i][1]:>14.4f}" for m in MODES))
    print(
        f"\n{'mode':<12}{'final loss':>11}{'state/node counted':>20}{'measured':>11}{'of full':>8}"
        f"{'sent/recv per sync':>24}{'syncs':>6}{'total sent+recv':>17}{'train s':>9}{'wall s':>8}"
    )
    for m in MODES:
        r = modes[m]
        state = max(r["trainable_state_bytes_per_node"], key=lambda s: s["counted"])
        per = r["bytes_per_step_per_node"][0] if m == "centralized" else r["bytes_per_sync_per_node"][0]
        count = report["config"]["steps"] if m == "centralized" else r["syncs"]
        total = sum(r["total_bytes_per_node"][0])
        unit = "/step" if m == "centralized" else ""
        print(
            f"{m:<12}{r['final_heldout_loss']:>11.4f}{_mb(state['counted']):>20}{_mb(state['measured']):>11}"
            f"{r['state_fraction_of_full']:>8.2f}{_mb(per[0]) + ' / ' + _mb(per[1]) + unit:>24}{count:>6}"
            f"{_mb(total):>17}{r['train_s_max']:>9.1f}{r['wall_s_max']:>8.1f}"
        )
    print(
        f"\nSPES - centralized final held-out loss: {report['spes_minus_centralized_loss']:+.4f} "
        f"({100 * report['spes_relative_to_centralized']:+.1f}%) at the same {modes['spes']['tokens']} tokens"
    )
    reference = report["reference_protocol_spes_over_diloco_bytes_per_round"]
    print(
        f"bytes per sync per node, SPES / full-model averaging: {report['spes_over_fedavg_bytes_per_sync']:.3f} "
        f"(the reference's server protocol would give {reference:.3f})"
    )
    outer = {m: max(s["outer"] for s in modes[m]["trainable_state_bytes_per_node"]) for m in ("spes", "fedavg")}
    print(
        f"outer optimizer in spes and fedavg: {outer_description(report['config'])}; its state per node "
        f"{_mb(outer['spes'])} (spes), {_mb(outer['fedavg'])} (fedavg)"
    )
    print(f"merges (step, alpha): {modes['spes']['merges']}")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    colors = {"centralized": "black", "fedavg": "tab:blue", "spes": "tab:red"}
    fig, (ax_steps, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.6))
    for mode, r in report["modes"].items():
        steps, losses = zip(*r["heldout_loss"])
        ax_steps.plot(steps, losses, marker="o", ms=3, color=colors[mode], label=mode)
        points = [
            (b / 1e6, loss) for (_, b), (_, loss) in zip(r["bytes_communicated_per_node"], r["heldout_loss"]) if b > 0
        ]
        ax_bytes.plot(*zip(*points), marker="o", ms=3, color=colors[mode], label=mode)
    ax_steps.set_xlabel("optimizer step (same tokens in every mode)")
    ax_bytes.set_xlabel("MB sent + received per node so far (log scale)")
    ax_bytes.set_xscale("log")
    for ax in (ax_steps, ax_bytes):
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{cfg['nodes']} nodes, sync every {cfg['sync_every']} steps, "
        f"{report['modes']['spes']['tokens']} training tokens, stdlib sources held out by file",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def outer_description(cfg) -> str:
    if cfg["outer_optimizer"] == "none":
        return "none (the plain average)"
    return f"{cfg['outer_optimizer']} (lr {cfg['outer_lr']:g}, momentum {cfg['outer_momentum']:g})"


def run_demo(cfg: SPESDemoConfig) -> dict:
    size = MOE_SIZES[cfg.model_size]
    print(
        f"odc-spes: {cfg.nodes} CPU node processes, OLMoE {size.num_hidden_layers} layers x {size.num_experts} "
        f"experts (top-{size.num_experts_per_tok}), {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} bytes "
        f"per node, sync every {cfg.sync_every}, outer optimizer {outer_description(asdict(cfg))}; "
        f"modes: {', '.join(MODES)}",
        flush=True,
    )
    start = time.perf_counter()
    per_node = run_ranks(node_body, cfg.nodes, cfg, timeout_s=3600)
    report = summarize(cfg, per_node, time.perf_counter() - start)
    os.makedirs(cfg.out_dir, exist_ok=True)
    json_path, png_path = os.path.join(cfg.out_dir, "odc_spes.json"), os.path.join(cfg.out_dir, "odc_spes.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, png_path)
    print_report(report)
    print(f"wall time {report['wall_s']:.1f} s\nreport: {json_path}\nplot: {png_path}")
    return report


def main(argv=None) -> None:
    defaults = SPESDemoConfig()
    p = argparse.ArgumentParser(allow_abbrev=False, prog="odc-spes", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=defaults.nodes)
    p.add_argument("--steps", type=int, default=defaults.steps, help="a multiple of --sync-every")
    p.add_argument("--sync-every", type=int, default=defaults.sync_every, help="local steps between syncs")
    p.add_argument("--outer-optimizer", choices=OUTER_OPTIMIZERS, default=defaults.outer_optimizer)
    p.add_argument("--outer-lr", type=float, default=defaults.outer_lr)
    p.add_argument("--outer-momentum", type=float, default=defaults.outer_momentum)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per node per step")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out", default=defaults.out_dir, help="directory for odc_spes.json and odc_spes.png")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file: name a directory (created if missing)")
    try:
        cfg = SPESDemoConfig(
            nodes=args.nodes,
            steps=args.steps,
            sync_every=args.sync_every,
            outer_optimizer=args.outer_optimizer,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            batch_size=args.batch_size,
            seed=args.seed,
            out_dir=args.out,
        )
    except ValueError as e:
        p.error(str(e))
    run_demo(cfg)


if __name__ == "__main__":
    main()
