"""Stock FSDP2 vs ODC when the work of a mini-batch is imbalanced across ranks.

Each mini-batch has M micro-batches per rank. In micro-batch i, rank i % W gets `--skew` times the
tokens of the others, so every rank's total is the same but every single micro-batch is lopsided:
FSDP2's per-layer collectives make each micro-batch cost its slowest rank, while ODC ranks only meet at
the end of the mini-batch. A balanced case (skew 1) shows ODC's own overhead. Both run in the same
processes, alternating mini-batch by mini-batch from identical weights, and the ratio of median step
times is printed.

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
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import apply_odc
from odc_plugin.launch import run_ranks
from odc_plugin.models import MODEL_SIZES, build_qwen2, shard_qwen2, token_mean_loss


TRANSPORT = {"cpu": "shm", "cuda": "cuda_ipc"}


def minibatch(rank, world, step, micro_batches, base_len, skew, vocab, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    seqs = []
    for i in range(micro_batches):
        length = base_len * (skew if i % world == rank else 1)
        seqs.append([torch.randint(0, vocab, (length,), generator=g).to(device)])
    return seqs


def sync(device):
    """Wait for queued GPU work, so that a step's time is its whole time."""
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def rank_body(rank, world, size, steps, micro_batches, base_len, skew, device, mixed_precision):
    if device == "cuda":
        torch.cuda.set_device(rank)
    mesh = init_device_mesh(device, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    fsdp_model = shard_qwen2(build_qwen2(size).to(device), mesh, mp)
    odc_model = shard_qwen2(build_qwen2(size).to(device), mesh, mp)
    odc = apply_odc(odc_model, make_transport(TRANSPORT[device]))
    runs = {"fsdp2": (fsdp_model, None), "odc": (odc_model, odc)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in runs.items()}
    vocab = MODEL_SIZES[size].vocab_size
    # Total tokens over all ranks: each micro-batch has one skewed rank.
    global_tokens = micro_batches * (base_len * (skew + world - 1) - world)
    times = {k: [] for k in runs}
    for step in range(steps + 1):  # step 0 warms up
        order = list(runs) if step % 2 == 0 else list(reversed(runs))
        for name in order:
            model, comm = runs[name]
            data = minibatch(rank, world, step, micro_batches, base_len, skew, vocab, device)
            sync(device)
            start = time.perf_counter()
            if comm:
                comm.begin()
            for seqs in data:
                token_mean_loss(model, seqs, global_tokens, world).backward()
            if comm:
                comm.end()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[name].step()
            opts[name].zero_grad()
            sync(device)
            if step:
                times[name].append(time.perf_counter() - start)
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
    args = p.parse_args()
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        p.error(f"--device cuda runs one rank per GPU: {args.ranks} ranks need {args.ranks} GPUs, "
                f"found {torch.cuda.device_count()}")
    if min(args.skews) < 1:
        p.error(f"--skews must be >= 1, got {args.skews}")
    where = "CPU ranks x 1 thread" if args.device == "cpu" else f"GPU ranks ({torch.cuda.get_device_name()})"
    print(f"{args.ranks} {where}, model '{args.model_size}'{' bf16/fp32' if args.mixed_precision else ''}, "
          f"{args.micro_batches} micro-batches per rank, base length {args.base_len}, {args.steps} timed "
          "mini-batches per mode")
    print(f"{'case':<28}{'fsdp2 s/step':>14}{'odc s/step':>12}{'fsdp2/odc':>11}")
    backend = "nccl" if args.device == "cuda" else "gloo"
    for skew in args.skews:
        times = run_ranks(rank_body, args.ranks, args.model_size, args.steps, args.micro_batches,
                          args.base_len, skew, args.device, args.mixed_precision, backend=backend)[0]
        ratios = [f / o for f, o in zip(times["fsdp2"], times["odc"])]
        fsdp, odc = statistics.median(times["fsdp2"]), statistics.median(times["odc"])
        label = f"skew {skew}x per micro-batch" if skew > 1 else "balanced (overhead)"
        print(f"{label:<28}{fsdp:>14.3f}{odc:>12.3f}{statistics.median(ratios):>11.3f}")


if __name__ == "__main__":
    main()
