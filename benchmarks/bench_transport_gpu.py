"""The cuda_ipc transport against plain torch on the same GPU, and the accumulate designs against each
other (for a machine with a GPU).

    python benchmarks/bench_transport_gpu.py --gib 1 --worlds 2 3 --programs 16 32 64

The accumulate kernels compared (docs/gpu.md says which of their figures decides the design):
  old      the unbounded kernel (benchmarks/accumulate_v0.py): one program per 1024 elements,
           one atomic add per element, every sender from element 0
  new/P    the transports' kernel (odc_plugin/comm/kernels.py): at most P programs looping over tiles,
           each sender from its own tile, atomic adds
  slots/P  per-source slots: each sender stores its gradient, in its own dtype, into its own slot in the
           owner's memory with the same kernel (plain stores), and the owner adds its slots locally
           without atomics. With slots as large as the shard and a barrier after the stores and after
           the folds, this is the design's best case: a transport would pipeline it through smaller slots.

Interference (first, in one process): a bf16 matmul loop on the default stream while a `--gib` GiB fp32
gradient is accumulated over and over on a high-priority side stream, as FSDP's reduce-scatter stream
runs beside backward compute: the matmul's TFLOP/s beside each kernel over its TFLOP/s alone, and the
kernel's GB/s beside the matmul. One process, because kernels of different processes on one GPU take
turns on it instead of sharing its SMs. Also what the new kernel compiles to (128-bit loads, vector atomics).

Transport (then, for each rank count W in --worlds; ranks are processes, one per GPU when there are as
many GPUs, else sharing them, so on one GPU the ratios are the transport path's overhead, not NVLink's
bandwidth):
- gather: every rank owns 1/W of the buffer and pulls all of it through `get` (its own shard included);
  against torch's device-to-device copy of the buffer.
- accumulate: every rank adds an fp32, then a bf16, gradient of its shard's size into every owner (W
  concurrent writers per owner) with each kernel; GB/s of source data added by all ranks, against
  torch's local, non-atomic add_ of the buffer.
Times are between barriers, so they cover the slowest rank. Sums are checked on every rank.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import sys
import time

import torch

from odc_plugin.comm.tiling import PROGRAMS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def kernel_names(programs: list[int]) -> list[str]:
    return ["old"] + [f"new/{p}" for p in programs] + [f"slots/{p}" for p in programs]


def _design(name: str) -> tuple[str, int]:
    design, _, programs = name.partition("/")
    return design, int(programs or 0)


def reference(nbytes: int, iters: int) -> dict[str, float]:
    """Single-process torch: D2D copy of `nbytes`, local add of nbytes of fp32 / bf16 source."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    acc = torch.zeros(nbytes // 4, device="cuda")
    result = {"copy": _time(lambda: dst.copy_(src), iters)}
    for name, dtype in DTYPES.items():
        grad = torch.ones(nbytes // 4, device="cuda", dtype=dtype)
        result[f"add {name}"] = _time(lambda g=grad: acc.add_(g), iters)
    return result


def vector_width(compiled) -> str:
    """What Triton compiled a launch's memory accesses to (from its PTX)."""
    ptx = compiled.asm["ptx"]
    loads = "128-bit loads" if re.search(r"ld\.global\S*\.v4\.", ptx) else "no 128-bit loads"
    atomics = "vector atomics" if re.search(r"(red|atom)\.\S*\.v[248]\.", ptx) else "scalar atomics"
    return f"{loads}, {atomics}"


def interference(numel: int, iters: int, programs: list[int], matmul_n: int) -> None:
    from accumulate_v0 import accumulate_v0

    from odc_plugin.comm import kernels

    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    grad, acc, slot = (torch.ones(numel, device="cuda") for _ in range(3))
    side = torch.cuda.Stream(priority=-1)  # FSDP2's reduce-scatter stream is high priority too

    def matmuls():
        for _ in range(iters):
            torch.matmul(a, b, out=out)

    def kernel(name):
        design, p = _design(name)
        if design == "old":
            return lambda: accumulate_v0(acc, grad)
        if design == "new":
            return lambda: kernels.accumulate(acc, grad, programs=p)
        return lambda: (kernels.store(slot, grad, programs=p), kernels.add(acc, slot, programs=p))

    matmul_s = _time(matmuls, 1) / iters
    tflops = 2 * matmul_n**3 / matmul_s / 1e12
    print(
        f"interference: bf16 matmul {matmul_n}^3 alone {tflops:.1f} TFLOP/s; beside it, on a high-priority stream, "
        f"accumulating a {numel * 4 / (1 << 30):.2f} GiB fp32 gradient over and over:"
    )
    print(f"  {'kernel':<10}{'alone GB/s':>12}{'beside GB/s':>13}{'matmul TFLOP/s':>16}{'matmul kept':>13}")
    for name in kernel_names(programs):
        fn = kernel(name)
        alone_s = _time(fn, iters)
        calls = math.ceil(iters * matmul_s / alone_s) + 1  # enough to run beside the whole matmul loop
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            events[0].record()
            for _ in range(calls):
                fn()
            events[1].record()
        events[2].record()
        matmuls()
        events[3].record()
        torch.cuda.synchronize()
        beside_s = events[0].elapsed_time(events[1]) / 1e3 / calls
        matmul_beside_s = events[2].elapsed_time(events[3]) / 1e3 / iters
        print(
            f"  {name:<10}{numel * 4 / alone_s / 1e9:>12.1f}{numel * 4 / beside_s / 1e9:>13.1f}"
            f"{2 * matmul_n**3 / matmul_beside_s / 1e12:>16.1f}{matmul_s / matmul_beside_s:>13.3f}"
        )
    compiled = kernels._launch(kernels.ATOMIC_ADD, acc, grad, "sys", 0, 1, programs[0])
    print(f"  new kernel, fp32 source, aligned: {vector_width(compiled)}")


def rank_body(rank, world, nbytes, iters, programs):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    from accumulate_v0 import accumulate_v0

    from odc_plugin.comm import kernels, make_transport

    t = make_transport("cuda_ipc")
    shard = nbytes // world
    n = shard // 4  # fp32 accumulator elements per rank
    params = t.alloc("params", shard, torch.uint8)
    acc = t.alloc("acc", n, torch.float32)
    inboxes = {name: t.alloc(f"inbox {name}", world * n, dtype) for name, dtype in DTYPES.items()}
    params.local.fill_(rank)
    out = torch.empty(world * shard, dtype=torch.uint8, device="cuda")
    owners = [(rank + k) % world for k in range(world)]
    acc_at = {owner: t.peer_tensor(acc, owner) for owner in owners}
    slot_at = {
        (name, owner): t.peer_tensor(inbox, owner)[rank * n : (rank + 1) * n]
        for name, inbox in inboxes.items()
        for owner in owners
    }

    def gather():
        for peer in owners:
            t.get(params, peer, 0, out[peer * shard : (peer + 1) * shard])

    def accumulate(name, dtype_name, grad):
        design, p = _design(name)
        for owner in owners:
            if design == "old":
                accumulate_v0(acc_at[owner], grad)
            elif design == "new":
                kernels.accumulate(acc_at[owner], grad, sender=rank, senders=world, programs=p)
            else:
                kernels.store(slot_at[dtype_name, owner], grad, sender=rank, senders=world, programs=p)
        if design == "slots":
            t.barrier(600.0)  # every sender's slots are in place
            inbox = inboxes[dtype_name].local
            for sender in range(world):
                kernels.add(acc.local, inbox[sender * n : (sender + 1) * n], programs=p)
            t.barrier(600.0)  # the slots may be written again

    def timed(fn) -> float:
        fn()  # warm-up (and Triton compilation)
        t.barrier(600.0)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        t.barrier(600.0)  # synchronizes the device, then waits for every rank
        return (time.perf_counter() - start) / iters

    result = {"gather": timed(gather)}
    correct = all(
        torch.equal(out[p * shard : (p + 1) * shard].cpu(), torch.full((shard,), p, dtype=torch.uint8))
        for p in range(world)
    )
    for dtype_name, dtype in DTYPES.items():
        grad = torch.ones(n, device="cuda", dtype=dtype)
        for name in kernel_names(programs):
            acc.local.zero_()
            t.barrier(600.0)  # no peer adds before the owner has zeroed
            result[f"{name} {dtype_name}"] = timed(lambda k=name, d=dtype_name, g=grad: accumulate(k, d, g))
            # every rank added 1.0 per call into every owner, the warm-up included
            correct = correct and bool(acc.local.eq(float(world * (iters + 1))).all().item())
    result["correct"] = correct
    t.close()
    return result


def report_world(world, nbytes, iters, programs, ref, results) -> None:
    ngpu = torch.cuda.device_count()
    gib = nbytes / (1 << 30)
    placement = f"{world} ranks on {min(ngpu, world)} GPU(s) ({torch.cuda.get_device_name(0)})"
    print(f"cuda_ipc transport, {placement}, buffer {gib:.2f} GiB, {iters} iterations")
    print(f"  results correct on every rank: {all(r['correct'] for r in results)}")
    gather_s = max(r["gather"] for r in results)
    ipc_bw = world * nbytes / gather_s / 1e9  # every rank gathered the whole buffer
    copy_bw = nbytes / ref["copy"] / 1e9
    print(
        f"  gather: {ipc_bw:.1f} GB/s aggregate ({gather_s * 1e3:.2f} ms per gather of {gib:.2f} GiB per rank); "
        f"torch D2D copy {copy_bw:.1f} GB/s; ratio transport/torch {ipc_bw / copy_bw:.3f}"
    )
    for dtype_name, dtype in DTYPES.items():
        add_bw = nbytes // 4 * dtype.itemsize / ref[f"add {dtype_name}"] / 1e9
        print(f"  accumulate {dtype_name}, GB/s of source added by all ranks (torch local add_ {add_bw:.1f} GB/s):")
        old_s = max(r[f"old {dtype_name}"] for r in results)
        for name in kernel_names(programs):
            acc_s = max(r[f"{name} {dtype_name}"] for r in results)
            acc_bw = world * world * (nbytes // world // 4) * dtype.itemsize / acc_s / 1e9
            over_old = "" if name == "old" else f"; {old_s / acc_s:.3f}x the old kernel"
            ratio = acc_bw / add_bw
            print(f"    {name:<10}{acc_bw:>9.1f} GB/s ({acc_s * 1e3:.2f} ms per round); ratio {ratio:.3f}{over_old}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=1.0, help="size of the sharded buffer, GiB")
    ap.add_argument(
        "--worlds", type=int, nargs="+", help="rank counts to run (default: one rank per GPU, or 2 and 3 on one GPU)"
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--programs",
        type=int,
        nargs="+",
        default=[PROGRAMS],
        help=f"grid bounds P of the new kernel and of the slots to compare (default {PROGRAMS}, the transports')",
    )
    ap.add_argument(
        "--matmul-n", type=int, default=8192, help="size of the square bf16 matmul of the interference test"
    )
    args = ap.parse_args(argv)
    if min(args.programs) < 1 or (args.worlds and min(args.worlds) < 1) or args.gib <= 0 or args.iters < 1:
        ap.error("--programs, --worlds and --iters must be >= 1 and --gib > 0")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench_transport_gpu.py measures GPU transports: this machine has no CUDA GPU "
            "(torch.cuda.is_available() is False). Nothing was measured."
        )
    if importlib.util.find_spec("triton") is None:
        sys.exit("bench_transport_gpu.py needs Triton (install the plugin's `gpu` extra). Nothing was measured.")
    from odc_plugin.launch import run_ranks

    ngpu = torch.cuda.device_count()
    worlds = args.worlds or ([ngpu] if ngpu > 1 else [2, 3])
    interference(int(args.gib * (1 << 30)) // 4, args.iters, args.programs, args.matmul_n)
    torch.cuda.empty_cache()
    for world in worlds:
        nbytes = int(args.gib * (1 << 30)) // (4 * world) * 4 * world  # whole fp32 elements per shard
        ref = reference(nbytes, args.iters)
        torch.cuda.empty_cache()
        results = run_ranks(rank_body, world, nbytes, args.iters, args.programs, timeout_s=1800)
        report_world(world, nbytes, args.iters, args.programs, ref, results)


if __name__ == "__main__":
    main()
