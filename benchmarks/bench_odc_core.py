"""Stock FSDP2 vs ODC on CPU ranks when the work of a mini-batch is imbalanced across ranks.

Each mini-batch has M micro-batches per rank. In micro-batch i, rank i % W gets `--skew` times the
tokens of the others, so every rank's total is the same but every single micro-batch is lopsided:
FSDP2's per-layer collectives make each micro-batch cost its slowest rank, while ODC ranks only meet at
the end of the mini-batch. A balanced case (skew 1) shows ODC's own overhead. Both run in the same
processes, alternating mini-batch by mini-batch from identical weights, and the ratio of median step
times is printed.

    python benchmarks/bench_odc_core.py --ranks 2 --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import apply_odc
from odc_plugin.launch import run_ranks
from odc_plugin.models import MODEL_SIZES, build_qwen2, shard_qwen2, token_mean_loss


def minibatch(rank, world, step, micro_batches, base_len, skew, vocab):
    g = torch.Generator().manual_seed(1000 * step + rank)
    seqs = []
    for i in range(micro_batches):
        length = base_len * (skew if i % world == rank else 1)
        seqs.append([torch.randint(0, vocab, (length,), generator=g)])
    return seqs


def rank_body(rank, world, size, steps, micro_batches, base_len, skew):
    mesh = init_device_mesh("cpu", (world,))
    fsdp_model = shard_qwen2(build_qwen2(size), mesh)
    odc_model = shard_qwen2(build_qwen2(size), mesh)
    odc = apply_odc(odc_model, make_transport("shm"))
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
            data = minibatch(rank, world, step, micro_batches, base_len, skew, vocab)
            dist.barrier()
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
            dist.barrier()
            if step:
                times[name].append(time.perf_counter() - start)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--base-len", type=int, default=512)
    p.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    args = p.parse_args()
    print(f"{args.ranks} CPU ranks x 1 thread, model '{args.model_size}', {args.micro_batches} micro-batches "
          f"per rank, base length {args.base_len}, {args.steps} timed mini-batches per mode")
    print(f"{'case':<28}{'fsdp2 s/step':>14}{'odc s/step':>12}{'fsdp2/odc':>11}")
    for skew in (3, 1):
        times = run_ranks(rank_body, args.ranks, args.model_size, args.steps, args.micro_batches,
                          args.base_len, skew)[0]
        ratios = [f / o for f, o in zip(times["fsdp2"], times["odc"])]
        fsdp, odc = statistics.median(times["fsdp2"]), statistics.median(times["odc"])
        label = f"skew {skew}x per micro-batch" if skew > 1 else "balanced (overhead)"
        print(f"{label:<28}{fsdp:>14.3f}{odc:>12.3f}{statistics.median(ratios):>11.3f}")


if __name__ == "__main__":
    main()
