"""ODC's GPU memory against stock FSDP2's: after offload, and the backward's peak with a lagging stream.

    PYTHONPATH=. python benchmarks/bench_memory_gpu.py [--ranks 2 3] [--model-size Qwen2.5-0.5B] [--json FILE]

Ranks are processes sharing one GPU: ODC's over the cuda_ipc transport (gloo between them), stock
FSDP2's in torch's fake process group of as many ranks (its collectives do nothing: NCCL takes one rank
per GPU), so both hold the same shards, buffers and streams; their arithmetic is not compared here (the
tests do). bf16 parameters, fp32 reduce (verl's mixed precision), AdamW. Per rank count and rank:

- after offload, as verl hands the GPU to the rollout: one training step, `zero_grad`, the parameters
  moved to the CPU as verl's param offload does (the optimizer state stays), ODC's regions released,
  `torch.cuda.empty_cache()`; torch.cuda.memory_allocated, and the bytes of the peers' regions the rank
  maps (CUDA IPC), against stock FSDP2's. Goal: equal within 1% (ODC keeps its transport's control words
  alone). Then, with expandable segments on (verl's setting after a weight sync), the parameters come back,
  the regions are built again and the model trains another step.
- the backward's peak: the rise of torch.cuda.max_memory_allocated over a backward mini-batch, ODC with
  every accumulate delayed by --lag-cycles on its stream, stock FSDP2 with every reduce-scatter delayed by
  as many cycles as ODC's accumulates of a group add up to. Goal: ODC's no higher than FSDP2's (+1%). For
  comparison, `odc stream recorded` is ODC as before issue 35 (the allocator told of the accumulate
  stream, compute waiting only for FSDP's reduce-scatter event).

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


class _RecordStreamInstead(list):
    """What ODC did before issue 35, in place of its list of sent inputs: the allocator is told of the
    accumulate stream, and nothing is held for the compute stream to wait on."""

    def append(self, sent) -> None:
        tensor, _ = sent
        tensor.record_stream(torch.cuda.current_stream(tensor.device))


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
        opc._sent = _RecordStreamInstead()
        out["peak_recorded"] = peak_rise()
        opc._sent = []
        opc.transport.accumulate = accumulate
    else:
        # as long a delay per group as ODC's accumulates add up to: data and used flags, to every rank
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(_LaggingReduceScatter(lag_cycles * 2 * world_size))
        out["peak"] = peak_rise()
    if opc:
        # what ODC held through every rollout before issue 35, the reference model (forward-only) its published copy
        built = opc.memory_bytes()
        out["held_built"], out["held_built_forward_only"] = built.regions, built.published
    model.to("cpu")  # verl's offload_fsdp2_model_to_cpu
    start = time.perf_counter()
    if opc:
        opc.release()
    out["release_s"] = time.perf_counter() - start
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out["allocated"] = torch.cuda.memory_allocated()
    out["reserved"] = torch.cuda.memory_reserved()
    out["mapped"] = opc.transport.mapped_bytes() if opc else 0
    if opc:
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
            "after offload within 1%": all(
                abs(o["allocated"] - f["allocated"]) <= 0.01 * f["allocated"] for o, f in zip(odc, fsdp2)
            ),
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
                f"  rank {rank} after offload: allocated odc {_mib(o['allocated'])}, fsdp2 {_mib(f['allocated'])} "
                f"({(o['allocated'] - f['allocated']) / max(f['allocated'], 1):+.3%}); reserved odc "
                f"{_mib(o['reserved'])}, fsdp2 {_mib(f['reserved'])}; IPC-mapped odc {o['mapped']} B, fsdp2 0 B"
            )
            print(
                f"  rank {rank} backward peak (rise over the mini-batch, lagging stream): odc {_mib(o['peak'])}, "
                f"fsdp2 {_mib(f['peak'])} ({o['peak'] / f['peak']:.3f}x), odc stream recorded "
                f"{_mib(o['peak_recorded'])} ({o['peak_recorded'] / f['peak']:.3f}x)"
            )
            print(
                f"  rank {rank} ODC's regions while built, all ODC held through the rollout before issue 35: "
                f"{_mib(o['held_built'])} (a reference model: {_mib(o['held_built_forward_only'])}); released: "
                f"{_mib(o['allocated'] - f['allocated'])} more than FSDP2 allocates"
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
