"""ODC's GPU memory against stock FSDP2's: the backward's peak with a lagging stream, and the rebuild.

    PYTHONPATH=. python benchmarks/bench_memory_gpu.py [--ranks 2 3] [--model-size Qwen2.5-0.5B] [--json FILE]

Ranks are processes sharing one GPU: ODC's over the cuda_ipc transport (gloo between them), stock
FSDP2's in torch's fake process group of as many ranks (its collectives do nothing: NCCL takes one rank
per GPU), so both hold the same shards, buffers and streams; their arithmetic is not compared here (the
tests do). bf16 parameters, fp32 reduce (verl's mixed precision), AdamW. Per rank count and rank:

- the backward's peak: the rise of torch.cuda.max_memory_allocated over a backward mini-batch, ODC with
  every accumulate delayed by --lag-cycles on its stream, stock FSDP2 with every reduce-scatter delayed by
  as many cycles as ODC's accumulates of a group add up to. Goal: ODC's no higher than FSDP2's (+1%).
- the rebuild, as around verl's rollout: the parameters offloaded and ODC's regions released, then with
  expandable segments on (verl's setting after a weight sync) the parameters back, the regions built
  again and another step trained. Goal: it trains, the regions in plain segments (CUDA IPC cannot share
  expandable ones). Memory after offload against FSDP2 is odc-check's.

Prints "nothing measured: no GPU" and exits 0 without CUDA or Triton.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch

from odc_plugin.fsdp._fsdp_internals import DefaultReduceScatter
from odc_plugin.launch import run_ranks
from odc_plugin.models import MODEL_SIZES

LAG_CYCLES = 2_000_000  # ~1 ms at an H100's clock


def _setup_fake_process_group() -> None:
    """Registers torch's fake backend (importing the module does) before the rank's group starts."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def _lagging(call, cycles: int):
    def delayed(*args, **kwargs):
        torch.cuda._sleep(cycles)  # on the stream the call enqueues on
        return call(*args, **kwargs)

    return delayed


class _LaggingReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, its stream delayed first."""

    def __init__(self, cycles: int):
        self.cycles = cycles

    def __call__(self, *args, **kwargs):
        torch.cuda._sleep(self.cycles)
        return super().__call__(*args, **kwargs)


def _expandable(pool_id=None) -> list[bool | None]:
    """Whether each segment of a pool (the default one: None) is expandable; None where torch does not say."""
    return [segment.get("is_expandable") for segment in torch.cuda.memory_snapshot(pool_id)]


def rank_body(rank, world_size, size, seq_len, micro_batches, lag_cycles, odc):
    """One rank's figures (see the module); `odc` False is stock FSDP2 in a fake process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from odc_plugin.comm import make_transport
    from odc_plugin.fsdp import ODCConfig, apply_odc
    from odc_plugin.models import build_qwen2, shard_qwen2, token_mean_loss

    torch.cuda.set_device(0)
    with torch.device("cuda"):
        model = build_qwen2(size, seed=0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_qwen2(model, init_device_mesh("cuda", (world_size,)), mp)
    opc = apply_odc(model, make_transport("cuda_ipc"), ODCConfig(barrier_timeout_s=300)) if odc else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(rank)
    vocab = MODEL_SIZES[size].vocab_size
    seqs = [torch.randint(0, vocab, (seq_len,), generator=g).cuda() for _ in range(micro_batches)]
    tokens = world_size * micro_batches * (seq_len - 1)

    def minibatch():
        if opc:
            opc.begin()
        for seq in seqs:
            token_mean_loss(model, [seq], tokens, world_size).backward()
        if opc:
            opc.end()

    def peak_rise() -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        minibatch()
        torch.cuda.synchronize()
        rise = torch.cuda.max_memory_allocated() - base
        opt.step()
        opt.zero_grad(set_to_none=True)
        return rise

    out = {}
    minibatch()  # the first step: the optimizer state, and everything a step keeps cached
    opt.step()
    opt.zero_grad(set_to_none=True)
    if opc:
        accumulate = opc.transport.accumulate
        opc.transport.accumulate = _lagging(accumulate, lag_cycles)
        out["peak"] = peak_rise()
        opc.transport.accumulate = accumulate
    else:
        # as long a delay per group as ODC's accumulates add up to: data and used flags, to every rank
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(_LaggingReduceScatter(lag_cycles * 2 * world_size))
        out["peak"] = peak_rise()
    if opc:
        model.to("cpu")  # verl's offload_fsdp2_model_to_cpu
        start = time.perf_counter()
        opc.release()
        out["release_s"] = time.perf_counter() - start
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
        model.to("cuda")
        start = time.perf_counter()
        opc.build()
        out["build_s"] = time.perf_counter() - start
        minibatch()
        opt.step()
        out["retrained"] = all(p.grad is not None for p in model.parameters())
        # the regions in segments cudaMalloc made, while the model's own memory went to expandable ones
        out["regions_expandable"] = [e for pool in opc.transport._pools.values() for e in _expandable(pool.id)]
        out["elsewhere_expandable"] = any(_expandable())
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3], help="rank counts sharing the GPU (default 2 3)")
    p.add_argument("--model-size", default="Qwen2.5-0.5B", choices=sorted(MODEL_SIZES), help="model shape")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per micro-batch (default 1024)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per rank (default 4)")
    p.add_argument("--lag-cycles", type=int, default=LAG_CYCLES, help="GPU cycles each accumulate is delayed")
    p.add_argument("--json", help="also write every rank's figures and the goals' verdicts to this file")
    args = p.parse_args(argv)
    if min(args.ranks) < 2:
        p.error(f"--ranks must be >= 2 (ODC needs peers), got {args.ranks}")
    return args


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        print("bench_memory_gpu.py: nothing measured: no GPU (or no Triton, which the cuda_ipc transport needs)")
        return 0
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {args.model_size}, bf16 params / fp32 reduce, "
        f"{args.micro_batches} micro-batches of {args.seq_len} tokens per rank, ranks sharing one GPU"
    )
    shared = (args.model_size, args.seq_len, args.micro_batches, args.lag_cycles)
    report, ok = {}, True
    for world in args.ranks:
        odc = run_ranks(rank_body, world, *shared, True)
        fsdp2 = run_ranks(rank_body, world, *shared, False, setup=_setup_fake_process_group, backend="fake")
        goals = {
            "backward peak not above FSDP2's (+1%)": all(o["peak"] <= 1.01 * f["peak"] for o, f in zip(odc, fsdp2)),
            "trains again after the rebuild, regions not in expandable segments": all(
                o["retrained"] and o["regions_expandable"] and not any(map(bool, o["regions_expandable"])) for o in odc
            ),
        }
        ok &= all(goals.values())
        report[world] = {"odc": odc, "fsdp2": fsdp2, "goals": goals}
        print(f"\n{world} ranks, per rank:")
        for rank, (o, f) in enumerate(zip(odc, fsdp2)):
            print(
                f"  rank {rank} backward peak (rise over the mini-batch, lagging stream): odc {_mib(o['peak'])}, "
                f"fsdp2 {_mib(f['peak'])} ({o['peak'] / f['peak']:.3f}x)"
            )
            print(
                f"  rank {rank} release {o['release_s'] * 1e3:.1f} ms, build {o['build_s'] * 1e3:.1f} ms; after "
                f"turning expandable segments on: the regions' segments expandable {o['regions_expandable']}, the "
                f"model's {o['elsewhere_expandable']}"
            )
        for goal, met in goals.items():
            print(f"  goal {goal}: {'met' if met else 'NOT MET'}")
    if args.json:
        with open(args.json, "w") as fp:
            json.dump(report, fp, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
