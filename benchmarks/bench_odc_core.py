"""The four A/B rows (odc_plugin/demo/rows.py) when every micro-batch is lopsided across ranks.

Each mini-batch has M micro-batches per rank. In micro-batch i, rank i % W gets `--skew` times the
tokens of the others, so every rank's total is the same but every single micro-batch is lopsided: this
layout is the plan of the three `lb_micro` rows, whose lockstep ones pay each micro-batch's slowest
rank at every layer; `odc+lb_mini` trains the same samples as LB-Mini spreads them. A balanced case
(skew 1) measures ODC's own overhead against the lockstep baseline on the same transport, and the
transport itself (stock FSDP2's collectives vs ODC's copies) as a separate factor. All rows run in the
same processes, taking turns mini-batch by mini-batch from identical weights. `--forward-only` adds a
balanced case of forward-only mini-batches (a log-prob or value pass: no gradient, no optimizer step, so
ODC's shards stay as they were published).

CPU ranks (gloo, shared-memory transport) by default. `--device cuda` runs one rank per GPU (NCCL,
CUDA IPC transport); with one rank it measures ODC's own overhead on a GPU (publishing shards, the
end-of-mini-batch synchronization) against stock FSDP2 on real model shapes, and on a GPU every row's
memory: what building it allocated (`held`: parameter shards, and ODC's regions), and its peak (held,
plus what its first mini-batch kept, optimizer state, plus the largest rise during a timed mini-batch),
for training and, with --forward-only, forward-only mini-batches; ODC's extra bytes per parameter of the
shard are its held bytes over stock FSDP2's:

    python benchmarks/bench_odc_core.py --ranks 2 --steps 6
    python benchmarks/bench_odc_core.py --device cuda --ranks 1 --skews 1 --model-size Qwen2.5-0.5B Qwen2.5-1.5B \
        --rows fsdp2+lb_micro odc+lb_micro --mixed-precision --base-len 4096 --steps 10 --forward-only
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from odc_plugin.balance import get_cost_model, lb_mini
from odc_plugin.demo.rows import (
    FACTORS,
    ROWS,
    build_rows,
    factors,
    infer_minibatch,
    plan_of,
    train_minibatch,
    turn_order,
)
from odc_plugin.launch import run_ranks
from odc_plugin.models import MODEL_SIZES, build_qwen2, qwen2_config, shard_qwen2, token_mean_loss

TRANSPORT = {"cpu": "shm", "cuda": "cuda_ipc"}


def skewed_plan(world, micro_batches, base_len, skew):
    """Sample lengths of one mini-batch and, per rank, its micro-batches of sample indices."""
    lengths, plan = [], [[] for _ in range(world)]
    for i in range(micro_batches):
        for rank in range(world):
            plan[rank].append([len(lengths)])
            lengths.append(base_len * (skew if i % world == rank else 1))
    return lengths, plan


def _allocated(device) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def rank_body(
    rank, world, size, steps, micro_batches, base_len, skew, device, mixed_precision, forward_only=False, names=ROWS
):
    """Each row's s/step per timed mini-batch, and on a GPU its memory (bytes) and the shard's parameter count."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    mesh = init_device_mesh(device, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    rows, memory = {}, {}
    for name in names:  # one at a time, to see what each allocates
        before = _allocated(device)
        rows |= build_rows(
            lambda: shard_qwen2(build_qwen2(size).to(device), mesh, mp), TRANSPORT[device], lr=1e-4, names=(name,)
        )
        memory[name] = {"held": _allocated(device) - before, "kept": 0, "rise": 0}
    vocab = MODEL_SIZES[size].vocab_size
    lengths, micro_plan = skewed_plan(world, micro_batches, base_len, skew)
    cost = get_cost_model("flops", model=qwen2_config(size))
    plans = {"lb_micro": micro_plan, "lb_mini": lb_mini(lengths, world, base_len * skew, cost=cost)}
    global_tokens = sum(lengths) - len(lengths)  # next-token targets over all ranks
    times = {row: [] for row in names}
    for step in range(steps + 1):  # step 0 warms up
        seqs = [
            torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1000 * step + i)).to(device)
            for i, n in enumerate(lengths)
        ]
        for row in turn_order(step, names):
            model = rows[row].model
            losses = [
                lambda mb=mb, m=model, s=seqs: token_mean_loss(m, [s[i] for i in mb], global_tokens, world)
                for mb in plans[plan_of(row)][rank]
            ]
            run = infer_minibatch if forward_only else train_minibatch
            before = _allocated(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            elapsed = run(rows[row], losses, device)["step_s"]
            if step:
                times[row].append(elapsed)
            if device == "cuda":
                m = memory[row]
                if step:
                    m["rise"] = max(m["rise"], torch.cuda.max_memory_allocated() - before)
                else:  # what the first mini-batch leaves allocated: optimizer state
                    m["kept"] = _allocated(device) - before
    model = next(iter(rows.values())).model
    shard_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return {"times": times, "memory": memory, "shard_params": shard_params}


def memory_line(memory: dict, shard_params: int) -> str:
    """Each row's held and peak GiB; ODC rows also their extra bytes per shard parameter over stock FSDP2."""
    base = memory.get(ROWS[0])
    parts = []
    for row, m in memory.items():
        extra = ""
        if base is not None and row != ROWS[0]:
            extra = f" (+{(m['held'] - base['held']) / shard_params:.2f} B/param over {ROWS[0]})"
        peak = m["held"] + m["kept"] + m["rise"]
        parts.append(f"{row} held {m['held'] / (1 << 30):.2f}{extra}, peak {peak / (1 << 30):.2f}")
    return "  memory GiB: " + "; ".join(parts)


# ODC against stock FSDP2 directly: the transport and ODC's own overhead together, what a world size of 1 shows
OVER_FSDP2 = ("odc_vs_fsdp2", (ROWS[0], ROWS[2]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--base-len", type=int, default=512)
    p.add_argument("--model-size", nargs="+", default=["small"], choices=list(MODEL_SIZES), help="one or more")
    p.add_argument(
        "--rows", nargs="+", default=list(ROWS), choices=ROWS, help="rows to run (default all; each holds a model)"
    )
    p.add_argument("--skews", type=int, nargs="+", default=[3, 1], help="1 is the balanced (overhead) case")
    p.add_argument("--device", default="cpu", choices=sorted(TRANSPORT))
    p.add_argument("--mixed-precision", action="store_true", help="bf16 parameters, fp32 gradient reduction")
    p.add_argument("--forward-only", action="store_true", help="also a balanced case of forward-only mini-batches")
    args = p.parse_args(argv)
    if min(args.skews) < 1:
        p.error(f"--skews must be >= 1, got {args.skews}")
    args.rows = tuple(row for row in ROWS if row in args.rows)  # in the rows' order, once each
    return args


def main():
    args = parse_args()
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        sys.exit(
            f"bench_odc_core.py: --device cuda runs one rank per GPU: --ranks {args.ranks}, found "
            f"{torch.cuda.device_count()} GPU(s). Nothing was measured."
        )
    where = "CPU ranks x 1 thread" if args.device == "cpu" else f"GPU ranks ({torch.cuda.get_device_name()})"
    names = [name for name, pair in [*FACTORS.items(), OVER_FSDP2] if set(pair) <= set(args.rows)]
    backend = "nccl" if args.device == "cuda" else "gloo"
    cases = [(skew, False) for skew in args.skews] + ([(1, True)] if args.forward_only else [])
    for size in args.model_size:
        print(
            f"{args.ranks} {where}, model '{size}'{' bf16/fp32' if args.mixed_precision else ''}, "
            f"{args.micro_batches} micro-batches per rank, base length {args.base_len}, {args.steps} timed "
            "mini-batches per row"
        )
        print(f"{'case':<28}" + "".join(f"{row:>19}" for row in args.rows) + "".join(f"{n:>17}" for n in names))
        for skew, forward_only in cases:
            out = run_ranks(
                rank_body,
                args.ranks,
                size,
                args.steps,
                args.micro_batches,
                args.base_len,
                skew,
                args.device,
                args.mixed_precision,
                forward_only,
                args.rows,
                backend=backend,
            )[0]
            times = out["times"]
            label = (
                "forward-only, balanced"
                if forward_only
                else f"skew {skew}x per micro-batch"
                if skew > 1
                else "balanced (overhead)"
            )
            medians = "".join(f"{statistics.median(times[row]):>19.3f}" for row in args.rows)
            found = factors(times)
            if OVER_FSDP2[0] in names:
                slow, fast = OVER_FSDP2[1]
                found[OVER_FSDP2[0]] = statistics.median(a / b for a, b in zip(times[slow], times[fast]))
            print(f"{label:<28}{medians}" + "".join(f"{found[n]:>16.3f}x" for n in names))
            if args.device == "cuda":
                print(memory_line(out["memory"], out["shard_params"]))
    print(
        "s/step medians per row; factors are medians of per-mini-batch ratios, slower row over faster "
        f"(odc+lb_mini: over lockstep; {OVER_FSDP2[0]}: {OVER_FSDP2[1][0]} over {OVER_FSDP2[1][1]})"
    )


if __name__ == "__main__":
    main()
