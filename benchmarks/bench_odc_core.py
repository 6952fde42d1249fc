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
end-of-mini-batch synchronization) against stock FSDP2 on a real model shape:

    python benchmarks/bench_odc_core.py --ranks 2 --steps 6
    python benchmarks/bench_odc_core.py --device cuda --ranks 1 --skews 1 --model-size Qwen2.5-0.5B \
        --mixed-precision --base-len 4096 --steps 10
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

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


def rank_body(rank, world, size, steps, micro_batches, base_len, skew, device, mixed_precision, forward_only=False):
    if device == "cuda":
        torch.cuda.set_device(rank)
    mesh = init_device_mesh(device, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    rows = build_rows(lambda: shard_qwen2(build_qwen2(size).to(device), mesh, mp), TRANSPORT[device], lr=1e-4)
    vocab = MODEL_SIZES[size].vocab_size
    lengths, micro_plan = skewed_plan(world, micro_batches, base_len, skew)
    cost = get_cost_model("flops", model=qwen2_config(size))
    plans = {"lb_micro": micro_plan, "lb_mini": lb_mini(lengths, world, base_len * skew, cost=cost)}
    global_tokens = sum(lengths) - len(lengths)  # next-token targets over all ranks
    times = {row: [] for row in ROWS}
    for step in range(steps + 1):  # step 0 warms up
        seqs = [
            torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1000 * step + i)).to(device)
            for i, n in enumerate(lengths)
        ]
        for row in turn_order(step):
            model = rows[row].model
            losses = [
                lambda mb=mb, m=model, s=seqs: token_mean_loss(m, [s[i] for i in mb], global_tokens, world)
                for mb in plans[plan_of(row)][rank]
            ]
            run = infer_minibatch if forward_only else train_minibatch
            elapsed = run(rows[row], losses, device)["step_s"]
            if step:
                times[row].append(elapsed)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--base-len", type=int, default=512)
    p.add_argument("--model-size", default="small", choices=list(MODEL_SIZES))
    p.add_argument("--skews", type=int, nargs="+", default=[3, 1], help="1 is the balanced (overhead) case")
    p.add_argument("--device", default="cpu", choices=sorted(TRANSPORT))
    p.add_argument("--mixed-precision", action="store_true", help="bf16 parameters, fp32 gradient reduction")
    p.add_argument("--forward-only", action="store_true", help="also a balanced case of forward-only mini-batches")
    args = p.parse_args()
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        p.error(
            f"--device cuda runs one rank per GPU: {args.ranks} ranks need {args.ranks} GPUs, "
            f"found {torch.cuda.device_count()}"
        )
    if min(args.skews) < 1:
        p.error(f"--skews must be >= 1, got {args.skews}")
    where = "CPU ranks x 1 thread" if args.device == "cpu" else f"GPU ranks ({torch.cuda.get_device_name()})"
    print(
        f"{args.ranks} {where}, model '{args.model_size}'{' bf16/fp32' if args.mixed_precision else ''}, "
        f"{args.micro_batches} micro-batches per rank, base length {args.base_len}, {args.steps} timed "
        "mini-batches per row"
    )
    names = [name for name, rows in FACTORS.items() if set(rows) <= set(ROWS)]  # the four rows' factors
    print(f"{'case':<28}" + "".join(f"{row:>19}" for row in ROWS) + "".join(f"{name:>17}" for name in names))
    backend = "nccl" if args.device == "cuda" else "gloo"
    cases = [(skew, False) for skew in args.skews] + ([(1, True)] if args.forward_only else [])
    for skew, forward_only in cases:
        times = run_ranks(
            rank_body,
            args.ranks,
            args.model_size,
            args.steps,
            args.micro_batches,
            args.base_len,
            skew,
            args.device,
            args.mixed_precision,
            forward_only,
            backend=backend,
        )[0]
        label = (
            "forward-only, balanced"
            if forward_only
            else f"skew {skew}x per micro-batch"
            if skew > 1
            else "balanced (overhead)"
        )
        medians = "".join(f"{statistics.median(times[row]):>19.3f}" for row in ROWS)
        print(f"{label:<28}{medians}" + "".join(f"{f:>16.3f}x" for f in factors(times).values()))
    print("s/step medians per row; factors are medians of per-mini-batch ratios (odc+lb_mini: over lockstep)")


if __name__ == "__main__":
    main()
