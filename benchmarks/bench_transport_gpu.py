"""The cuda_ipc transport against plain torch copies and adds on the GPU (for a machine with a GPU).

gather: every rank owns 1/W of a `--gib` GiB buffer and pulls the whole buffer through `get` (its own
shard included), so W ranks move W * GiB; compared with torch's device-to-device copy of GiB bytes.
accumulate: every rank adds an fp32 (then bf16) gradient of its shard's size into every owner (atomic
adds into peer memory, W concurrent writers per owner); GB/s of source data added, compared with a
local, non-atomic `add_` of the same data.

W ranks are processes: one per GPU when there are several (the gather then crosses NVLink/P2P), or W on
GPU 0 when there is one (the same memory, reached through CUDA IPC mappings: the ratio is the overhead of
the transport path). Times are between barriers, so they cover the slowest rank.

    python benchmarks/bench_transport_gpu.py --gib 1 --iters 5
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch


def _time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def reference(nbytes: int, iters: int) -> dict[str, float]:
    """Single-process torch: D2D copy of `nbytes`, local add of nbytes of fp32 / bf16 source."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    acc = torch.zeros(nbytes // 4, device="cuda")
    g32 = torch.ones(nbytes // 4, device="cuda")
    g16 = g32.to(torch.bfloat16)
    return {
        "copy_s": _time(lambda: dst.copy_(src), iters),
        "add_fp32_s": _time(lambda: acc.add_(g32), iters),
        "add_bf16_s": _time(lambda: acc.add_(g16), iters),
    }


def rank_body(rank, world, nbytes, iters):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    from odc_plugin.comm import make_transport

    t = make_transport("cuda_ipc")
    shard = nbytes // world
    params = t.alloc("params", shard, torch.uint8)
    acc = t.alloc("acc", shard // 4, torch.float32)
    params.local.fill_(rank)
    out = torch.empty(world * shard, dtype=torch.uint8, device="cuda")
    g32 = torch.ones(shard // 4, device="cuda")
    g16 = g32.to(torch.bfloat16)

    def gather():
        for k in range(world):
            peer = (rank + k) % world
            t.get(params, peer, 0, out[peer * shard : (peer + 1) * shard])

    def accumulate(src):
        for k in range(world):
            t.accumulate(acc, (rank + k) % world, 0, src)

    result = {}
    for name, fn in (("gather", gather), ("acc_fp32", lambda: accumulate(g32)), ("acc_bf16", lambda: accumulate(g16))):
        fn()  # warm-up (and Triton compilation)
        t.barrier(600.0)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        t.barrier(600.0)  # synchronizes the device, then waits for every rank
        result[name] = (time.perf_counter() - start) / iters
    ok = all(
        torch.equal(out[p * shard : (p + 1) * shard].cpu(), torch.full((shard,), p, dtype=torch.uint8))
        for p in range(world)
    )
    expected = float(world * (2 * iters + 2))  # every rank added 1.0 per call: warm-ups included
    result["correct"] = ok and bool(acc.local.eq(expected).all().item())
    t.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the sharded buffer, GiB")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: one per GPU, or 2 on one GPU)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench_transport_gpu.py measures GPU transports: this machine has no CUDA GPU "
            "(torch.cuda.is_available() is False). Nothing was measured."
        )
    if importlib.util.find_spec("triton") is None:
        sys.exit("bench_transport_gpu.py needs Triton (install the plugin's `gpu` extra). Nothing was measured.")
    from odc_plugin.launch import run_ranks

    ngpu = torch.cuda.device_count()
    world = args.world or (ngpu if ngpu > 1 else 2)
    nbytes = int(args.gib * (1 << 30)) // (4 * world) * 4 * world  # whole fp32 elements per shard
    ref = reference(nbytes, args.iters)
    torch.cuda.empty_cache()
    results = run_ranks(rank_body, world, nbytes, args.iters, timeout_s=1800)
    gib, placement = nbytes / (1 << 30), f"{world} ranks on {min(ngpu, world)} GPU(s) ({torch.cuda.get_device_name(0)})"
    print(f"cuda_ipc transport, {placement}, buffer {gib:.2f} GiB, {args.iters} iterations")
    print(f"results correct on every rank: {all(r['correct'] for r in results)}")
    gather_s = max(r["gather"] for r in results)
    ipc_bw = world * nbytes / gather_s / 1e9  # every rank gathered the whole buffer
    copy_bw = nbytes / ref["copy_s"] / 1e9
    print(
        f"gather : {ipc_bw:8.1f} GB/s aggregate ({gather_s * 1e3:.2f} ms per gather of {gib:.2f} GiB per rank); "
        f"torch D2D copy {copy_bw:.1f} GB/s; ratio transport/torch = {ipc_bw / copy_bw:.3f}"
    )
    for dtype, key, ref_key in (("fp32", "acc_fp32", "add_fp32_s"), ("bf16", "acc_bf16", "add_bf16_s")):
        elem = 4 if dtype == "fp32" else 2
        acc_s = max(r[key] for r in results)
        acc_bw = world * world * (nbytes // world // 4) * elem / acc_s / 1e9  # source bytes added, all ranks
        add_bw = (nbytes // 4) * elem / ref[ref_key] / 1e9
        print(
            f"accumulate {dtype}: {acc_bw:8.1f} GB/s of source aggregate ({acc_s * 1e3:.2f} ms per round); "
            f"torch local add_ {add_bw:.1f} GB/s; ratio transport/torch = {acc_bw / add_bw:.3f}"
        )


if __name__ == "__main__":
    main()
