"""Calibrate the `fit` cost model: forward+backward seconds of one Qwen2 decoder layer vs sequence length.

FlopsCost assumes every FLOP costs the same, but on a GPU attention kernels and matmuls run at different
efficiencies, and short sequences do not fill the GPU, so the split between the s^2 (attention) and s
(linear layers) terms has to be measured. This times one decoder layer shaped like a QWEN2_5_PRESETS model
(random init, SDPA causal attention, rotary embeddings) on one sequence of each length, fits
t(s) = a*s^2 + b*s by least relative error, and writes a CostCalibration JSON for
`odc-plan --cost fit --fit-file FILE` (and a, b for odc_cost_fit_a / odc_cost_fit_b).

    python benchmarks/calibrate_cost.py --model Qwen2.5-7B
    python benchmarks/calibrate_cost.py --device cpu --dtype fp32 --hidden-size 64 --intermediate-size 96 \\
        --heads 4 --kv-heads 2 --seqlens 32 64 128 --iters 2 --out /tmp/tiny.json
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch

from odc_plugin.balance.costs import QWEN2_5_PRESETS, CostCalibration, FitCost, fit_quadratic

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Preset keys each shrinking option replaces.
OVERRIDES = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
}
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "configs" / "cost_fit"


def build_layer(shape: dict[str, int], device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    config = Qwen2Config(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        layer = Qwen2DecoderLayer(config, layer_idx=0).to(dtype)
        rotary = Qwen2RotaryEmbedding(config)
    return layer, rotary


def time_layer(layer, rotary, seqlen: int, iters: int, warmup: int) -> float:
    """Median seconds of one forward+backward of a single sequence (batch 1)."""
    param = next(layer.parameters())
    device, dtype = param.device, param.dtype
    x = torch.randn(1, seqlen, layer.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    position_ids = torch.arange(seqlen, device=device)[None]
    # The model computes cos/sin once for all its layers, so they stay out of a layer's time.
    position_embeddings = rotary(x, position_ids)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times = []
    for i in range(warmup + iters):
        # FSDP hands each backward fresh gradients to reduce-scatter: no accumulation into old ones.
        layer.zero_grad(set_to_none=True)
        x.grad = None
        sync()
        start = time.perf_counter()
        out = layer(x, position_ids=position_ids, position_embeddings=position_embeddings)
        out.backward(grad)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def main(argv: list[str] | None = None) -> CostCalibration:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="Qwen2.5-7B", choices=list(QWEN2_5_PRESETS))
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--iters", type=int, default=10, help="timed runs per length; the median is kept")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per length first")
    p.add_argument("--out", metavar="FILE.json", help="default: configs/cost_fit/<model>-<device name>.json")
    shrink = p.add_argument_group("layer shape", "replace the preset's numbers, e.g. a tiny layer for a CPU smoke test")
    for option in OVERRIDES:
        shrink.add_argument(f"--{option.replace('_', '-')}", type=int)
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if min(args.seqlens) < 1 or len(set(args.seqlens)) < 2:
        p.error("--seqlens needs at least two distinct lengths, all >= 1")
    overrides = {key: getattr(args, option) for option, key in OVERRIDES.items() if getattr(args, option) is not None}
    if overrides and not args.out:
        p.error("a changed layer shape needs --out, so that it does not replace the preset's calibration")
    shape = {**QWEN2_5_PRESETS[args.model], **overrides}

    device = torch.device(args.device)
    name = device_name(device)
    layer, rotary = build_layer(shape, device, DTYPES[args.dtype])
    seqlens = sorted(set(args.seqlens))
    layer_shape = {k: shape[k] for k in OVERRIDES.values()}
    print(
        f"{args.model} layer ({', '.join(f'{k}={v}' for k, v in layer_shape.items())}) on {name}, {args.dtype}: "
        f"median of {args.iters} forward+backward per length"
    )
    times = [time_layer(layer, rotary, s, args.iters, args.warmup) for s in seqlens]
    a, b = fit_quadratic(seqlens, times)
    fitted = FitCost(a, b).costs(seqlens)
    errors = [f / t - 1 for f, t in zip(fitted, times)]

    print(f"{'seqlen':>7} {'measured ms':>12} {'fitted ms':>10} {'error':>7}")
    for s, t, f, e in zip(seqlens, times, fitted, errors):
        print(f"{s:>7} {t * 1e3:>12.3f} {f * 1e3:>10.3f} {e:>+7.1%}")
    crossover = f"; a*s^2 = b*s at s = {b / a:.0f}" if a else ""
    print(f"a = {a:.4g} s/token^2, b = {b:.4g} s/token per layer{crossover}")

    calibration = CostCalibration(
        model=args.model,
        device=name,
        dtype=args.dtype,
        a=a,
        b=b,
        unit=CostCalibration.UNIT,
        points=[[s, t] for s, t in zip(seqlens, times)],
        max_rel_error=max(map(abs, errors)),
        layer=layer_shape,
    )
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = Path(args.out) if args.out else DEFAULT_OUT_DIR / f"{args.model}-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    calibration.save(out)
    print(f"wrote {out}")
    return calibration


if __name__ == "__main__":
    main()
