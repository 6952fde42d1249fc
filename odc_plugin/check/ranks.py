"""What every rank of odc-check runs: the checks and measurements, collective over the group, in order.

1. the start-up check of peer adds (comm/peer_atomics.py) with each accumulate method the transport offers;
2. the transport against the group's collectives at one decoder layer's shard of the named model
   (comm/calibrate.py), which picks the accumulate method among those whose adds were exact;
3. correctness with it: a small Qwen2-shaped model trained a few SGD steps by stock FSDP2 on an even split
   of the samples, then by ODC on an uneven split of the same samples (every rank but the first runs one
   micro-batch, the first the rest); the worst relative difference between the parameters' updates;
4. the device's matmul throughput (the verdict's compute per layer) and, on GPUs, with the accumulates
   running beside it on a high-priority stream, as FSDP's reduce-scatter stream is;
5. memory after the model is offloaded, as verl does before the rollout: ODC against stock FSDP2, in torch's
   counts and as the driver sees this process (NVML, or nvidia-smi);
6. the Ulysses all-to-all that `odc_split` runs (comm/calibrate.py: calibrate_all_to_all), over the aligned
   groups of ranks the named model's heads allow inside this node, at one layer's messages of a micro-batch
   and a small one: per group size the fitted latency and bandwidth, which the engine options
   odc_split_latency_s and odc_split_bandwidth hand to the planner.

A failed check ends the run on every rank alike (each result is the same on every rank, or reduced over
them), and the rest is skipped: no method with exact adds, or training that differs from FSDP2's.
"""

from __future__ import annotations

import gc
import math
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ..balance.split import UlyssesModel
from ..comm import DelegatingTransport, Transport, make_transport, peer_atomics
from ..comm.calibrate import AllToAllCalibration, Bucket, calibrate, calibrate_all_to_all
from ..fsdp import ODCConfig, apply_odc
from ..models import build_qwen2, shard_qwen2, token_mean_loss
from .environment import environment
from .verdict import LayerShape

CORRECTNESS_MODEL = "small"
CORRECTNESS_RTOL = 1e-4  # fp32 sums taken in another order differ by ~1e-6


@dataclass(frozen=True)
class CheckOptions:
    device: str
    """"cpu" (shm transport) or "cuda" (cuda_ipc)."""
    model: str
    """A preset name or a model directory: the sizes the transport is measured at and the verdict is for."""
    micro_batch_tokens: int
    """Tokens of one micro-batch for the verdict's compute per layer."""
    steps: int
    """SGD steps of the correctness check."""
    timeout_s: float
    """How long a rank waits for a peer in any wait."""
    test_delay_s: float = 0.0
    """Tests only: while the transport is measured, every get and accumulate takes this much longer (a slow
    link on purpose)."""
    test_lossy_pair: tuple[int, int] | None = None
    """Tests only: (sender, owner) whose adds lose their first element (a link without working peer adds)."""


class _Handicapped(DelegatingTransport):
    """The transport as the tests make it worse: slower, or losing one pair's adds."""

    def __init__(self, inner: Transport, options: CheckOptions):
        super().__init__(inner)
        self.options = options
        self.delay_s = 0.0

    def get(self, region, peer, offset, out):
        time.sleep(self.delay_s)
        super().get(region, peer, offset, out)

    def accumulate(self, region, peer, offset, src):
        time.sleep(self.delay_s)
        if (self.rank, peer) == self.options.test_lossy_pair:
            src = src.clone()
            src.view(-1)[0] = 0.0
        super().accumulate(region, peer, offset, src)


def check_rank(rank: int, world_size: int, options: CheckOptions) -> dict:
    """Run every check on this rank; every rank returns the same dict (rank 0's is reported)."""
    device = torch.device(options.device, rank % torch.cuda.device_count() if options.device == "cuda" else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report: dict = {"environment": environment(), "ranks": world_size, "backend": str(dist.get_backend())}
    transport = make_transport("shm" if device.type == "cpu" else "cuda_ipc")
    report["transport"] = transport.name
    if device.type == "cuda":
        report["start_probe_fallback"] = transport.probe_fallback
    if options.test_delay_s or options.test_lossy_pair:
        transport = _Handicapped(transport, options)
    report["probe"] = {m: _probe(transport, device, m) for m in transport.accumulate_methods()}
    exact = [m for m, probe in report["probe"].items() if probe["passed"]]
    if not exact:
        return report
    layer = LayerShape.of(options.model)
    bucket = Bucket(math.ceil(layer.params / world_size))
    report["layer"] = {"model": options.model, "params": layer.params, "layers": layer.layers, "shard": bucket.numel}
    # picks the accumulate method the rest runs with, among those whose adds came out exact
    if isinstance(transport, _Handicapped):
        transport.delay_s = options.test_delay_s
    report["calibration"] = calibrate(transport, None, [bucket], methods=exact, repeats=3, timeout_s=options.timeout_s)
    if isinstance(transport, _Handicapped):
        transport.delay_s = 0.0
    report["correctness"] = _correctness(transport, device, world_size, options)
    if not report["correctness"]["passed"]:
        return report
    report["compute"] = _compute(transport, device, bucket, options)
    report["memory"] = _memory(transport, device, world_size)
    report["all_to_all"] = _all_to_all(device, world_size, options)
    return report


# The small message of the all-to-all's fit: a few tokens' worth, its time nearly all start-up.
SMALL_MESSAGE_BYTES = 64 << 10


def _all_to_all(device, world_size: int, options: CheckOptions) -> AllToAllCalibration | str:
    """The all-to-all over every group size odc_split may use here for `options.model` (aligned powers of
    two inside the node, as its heads allow), at the messages verl's Ulysses attention sends for a micro-batch
    of `options.micro_batch_tokens` tokens a rank (one layer's q or attention output, and its k or v: bf16)
    and a small one; or why no group size is possible here."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    ulysses = UlyssesModel.from_config(options.model, gpus_per_node=min(per_node, world_size))
    sizes = ulysses.group_sizes(world_size)[1:]
    flops = LayerShape.of(options.model).flops
    if not sizes:
        return (
            f"{options.model}'s {flops.num_attention_heads} heads ({flops.num_key_value_heads} kv) allow no group "
            f"of 2 or more aligned ranks among {world_size} ({per_node} on this node)"
        )
    q, kv = flops.num_attention_heads * flops.head_dim, flops.num_key_value_heads * flops.head_dim
    messages = [SMALL_MESSAGE_BYTES] + [options.micro_batch_tokens * width * 2 for width in (kv, q)]
    if len(set(messages)) < 2:
        messages.append(4 * max(messages))
    # NCCL's all-to-alls take microseconds, so each sample runs ten; gloo's (CPU, or ranks sharing a GPU) take
    # milliseconds
    repeats, iters = (7, 10) if dist.get_backend() == "nccl" else (5, 2)
    return calibrate_all_to_all(None, sizes, messages, device=device, repeats=repeats, iters=iters)


def _probe(transport: Transport, device: torch.device, method: str) -> dict:
    transport.set_accumulate_method(method)
    names = [f"{device.type}-rank{r}" for r in range(transport.world_size)]
    try:
        seconds = peer_atomics.check(transport, names, [None] * transport.world_size)
    except peer_atomics.PeerAddsError as e:
        return {"passed": False, "method": transport.accumulate_method, "error": str(e)}
    return {"passed": True, "method": transport.accumulate_method, "seconds": seconds}


def _samples(world_size: int, vocab: int) -> list[torch.Tensor]:
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    return [torch.randint(vocab, (rng.randint(8, 48),), generator=g) for _ in range(3 * world_size)]


def _uneven_shares(n: int, world_size: int) -> list[list[int]]:
    """One sample on every rank but the first, which runs the rest: the counts differ at every rank count, two
    included, and add up to the `n` samples FSDP2 trains, so that both train on the same batch."""
    sizes = [n - world_size + 1] + [1] * (world_size - 1)
    starts = [sum(sizes[:r]) for r in range(world_size)]
    return [list(range(s, s + k)) for s, k in zip(starts, sizes)]


def _train(device, world_size, seqs, share, steps, transport=None) -> dict[str, torch.Tensor]:
    """`steps` SGD steps (linear in the gradients: no Adam to amplify a near-zero gradient's rounding into a
    whole step), this rank running `share` one sample per micro-batch; how far its parameter shards moved,
    and where they ended."""
    model = shard_qwen2(build_qwen2(CORRECTNESS_MODEL, seed=0).to(device), init_device_mesh(device.type, (world_size,)))
    odc = apply_odc(model, transport, ODCConfig(barrier_timeout_s=600)) if transport else None

    def shards() -> dict[str, torch.Tensor]:
        return {
            n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
        }

    start = shards()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = sum(len(s) - 1 for s in seqs)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if odc:
            odc.begin()
        for i in share:
            token_mean_loss(model, [seqs[i].to(device)], tokens, world_size).backward()
        if odc:
            odc.end()
        opt.step()
    if odc:
        odc.release()  # the transport goes on to the next checks
    return {n: (p - start[n], p) for n, p in shards().items()}


def ulp(t: torch.Tensor) -> torch.Tensor:
    """Each element's unit in the last place: the gap to the next representable value away from zero."""
    magnitude = t.abs()
    return torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude


def _correctness(transport, device, world_size, options) -> dict:
    seqs = _samples(world_size, build_qwen2(CORRECTNESS_MODEL).config.vocab_size)
    even = list(range(dist.get_rank(), len(seqs), world_size))
    uneven = _uneven_shares(len(seqs), world_size)
    fsdp = _train(device, world_size, seqs, even, options.steps)
    odc = _train(device, world_size, seqs, uneven[dist.get_rank()], options.steps, transport)
    # each parameter's update, relative to its own size, or to a thousandth of the largest where it is smaller
    # (a gradient that is zero but for rounding, as attention's key bias gets, has no relative error to speak of);
    # an update is read back from fp32 parameters, so what differs within one unit in the last place of the
    # parameter is its rounding, not the training (a norm's weight near 1 moves by a few ULPs a step)
    norms = torch.tensor([u.norm().item() for u, _ in fsdp.values()], dtype=torch.float64, device=device) ** 2
    dist.all_reduce(norms)  # every rank holds one shard of each parameter
    floor = 1e-3 * norms.max().sqrt().item()
    errors = torch.tensor(
        [((odc[n][0] - u).abs() - ulp(final)).clamp_min(0).norm().item() ** 2 for n, (u, final) in fsdp.items()],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(errors)
    worst = max(e / max(n, floor) for e, n in zip(errors.sqrt().tolist(), norms.sqrt().tolist()))
    return {
        "passed": worst <= CORRECTNESS_RTOL,
        "worst": worst,
        "limit": CORRECTNESS_RTOL,
        "model": CORRECTNESS_MODEL,
        "steps": options.steps,
        "odc_micro_batches": [len(s) for s in uneven],
        "fsdp_micro_batches": [len(range(r, len(seqs), world_size)) for r in range(world_size)],
    }


def _matmul_s(device, n: int, dtype, iters: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty_like(a)
    torch.matmul(a, b, out=out)  # warm
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b, out=out)
    _sync(device)
    return (time.perf_counter() - start) / iters


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute(transport, device, bucket: Bucket, options: CheckOptions) -> dict:
    """The device's matmul FLOP/s (slowest rank), and on GPUs what it keeps with accumulates beside it."""
    n, dtype, iters = (8192, torch.bfloat16, 20) if device.type == "cuda" else (512, torch.float32, 5)
    alone_s = _matmul_s(device, n, dtype, iters)
    result = {"dtype": str(dtype).removeprefix("torch."), "size": n}
    if device.type == "cuda":
        result["kept_beside_accumulates"] = _kept_beside_accumulates(transport, device, bucket, n, alone_s, options)
    seconds = torch.tensor(alone_s, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    result["flops_per_s"] = 2 * n**3 / seconds.item()
    return result


def _kept_beside_accumulates(transport, device, bucket, n, alone_s, options) -> float:
    """The matmul's throughput with this rank accumulating a layer's gradient into every owner, over and over,
    on a high-priority stream meanwhile, as a fraction of its throughput alone (the slowest rank's)."""
    accumulator = transport.alloc("odc.check.accumulator", bucket.numel, torch.float32)
    grads = torch.ones(bucket.numel, device=device)
    a, b = (
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
    )
    side = torch.cuda.Stream(device, priority=-1)
    iters = max(1, round(0.5 / alone_s))  # about half a second of matmuls
    torch.cuda.synchronize(device)
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        for _ in range(iters):  # more than the matmuls need to be busy beside them throughout
            for step in range(transport.world_size):
                transport.accumulate(accumulator, (transport.rank + step) % transport.world_size, 0, grads)
        done.record(side)
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    torch.cuda.current_stream(device).synchronize()
    beside_s = (time.perf_counter() - start) / iters
    done.synchronize()
    transport.barrier(options.timeout_s)
    del accumulator
    transport.free("odc.check.accumulator")
    kept = torch.tensor(alone_s / beside_s, dtype=torch.float64, device=device)
    dist.all_reduce(kept, op=dist.ReduceOp.MIN)
    return kept.item()


def _driver_bytes() -> int | None:
    """Device memory this process holds as the driver counts it (NVML, else nvidia-smi); None where neither
    answers."""
    pid = os.getpid()
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid), 0)
    except Exception:  # noqa: BLE001 - not installed, or no NVML: ask nvidia-smi
        pass
    if not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) << 20
    return None


def _memory(transport, device, world_size: int) -> dict:
    """Each strategy's model trained one step then offloaded as verl offloads it (ODC's regions released
    first, as the odc engine does): what stays on the device, the largest over ranks, in torch's counts and the
    driver's. On CPU, what ODC holds built and released."""
    seqs = _samples(world_size, build_qwen2(CORRECTNESS_MODEL).config.vocab_size)
    tokens = sum(len(s) - 1 for s in seqs)
    result = {}
    for strategy in ("fsdp2", "odc"):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model = shard_qwen2(
            build_qwen2(CORRECTNESS_MODEL, seed=0).to(device), init_device_mesh(device.type, (world_size,))
        )
        odc = apply_odc(model, transport) if strategy == "odc" else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if odc:
            odc.begin()
        for i in range(dist.get_rank(), len(seqs), world_size):
            token_mean_loss(model, [seqs[i].to(device)], tokens, world_size).backward()
        if odc:
            odc.end()
            result["odc_built_bytes"] = odc.memory_bytes().held
        opt.step()
        if odc:
            odc.release()
            result["odc_released_bytes"] = odc.memory_bytes().held
        if device.type != "cuda":
            continue
        model.to("cpu")  # verl's offload_fsdp2_model_to_cpu, and its optimizer offload
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        figures = torch.tensor(
            [torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), _driver_bytes() or -1],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        result[strategy] = dict(zip(("allocated", "reserved", "driver"), figures.tolist()))
    return result
