"""`odc-check`: before a first odc job, measure ODC on this machine against what it replaces, and say whether
it will help here.

    odc-check --gpus 8                        # this node's GPUs, one rank each (its own launcher)
    torchrun --nproc-per-node 8 -m odc_plugin.check
    odc-check --cpu --ranks 4                 # CPU ranks over shared memory and gloo (2 without --ranks)

No verl, Ray or vLLM is needed (the planner's prediction uses verl's own balancing where verl is
installed). It prints one screen, and with `--json FILE` writes the same as JSON: the environment and the
start-up check of peer adds; ODC's transport against the process group's collectives at one decoder
layer of `--model` (its accumulate methods, and on GPUs a matmul's throughput beside them); a small model
trained by ODC on uneven micro-batch counts against stock FSDP2 on even ones, over the same samples; memory
after offload as the driver sees it; the all-to-all of `odc_split` (Ulysses) over the groups of ranks the
model allows, with the engine settings that give the planner the measured figures; and a verdict in one
line. It exits 0, or 1 when a check failed (no accumulate method adds exactly, or ODC trains otherwise than
FSDP2), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from ..balance.common import NVLINK_BW
from ..balance.split import A2A_LATENCY_S
from ..cli_args import number_arg
from ..comm.calibrate import AllToAllCalibration
from .ranks import CheckOptions, check_rank
from .verdict import LayerShape, Verdict, balanced_overhead, planned_speedup

# On CPU a 7B layer's buckets take GBs per rank and minutes on a few cores: a 0.5B layer keeps the check short.
DEFAULT_MODEL = {"cuda": "Qwen2.5-7B", "cpu": "Qwen2.5-0.5B"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="odc-check", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", type=number_arg(int, 2, strict=False), help="run N ranks, one per GPU of this node")
    where.add_argument("--cpu", action="store_true", help="run on CPU ranks (shm transport, gloo)")
    p.add_argument(
        "--ranks", type=number_arg(int, 2, strict=False), help="with --cpu: how many ranks (>= 2, default 2)"
    )
    p.add_argument(
        "--model",
        help="a model preset (e.g. Qwen2.5-7B) or a directory with its config.json: the layer the transport is "
        f"measured at and the verdict is for (default {DEFAULT_MODEL['cuda']} on GPUs, {DEFAULT_MODEL['cpu']} on CPU)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=number_arg(int, 1, strict=False),
        default=4096,
        help="tokens of one micro-batch, for the verdict's compute per layer (default 4096)",
    )
    p.add_argument(
        "--steps", type=number_arg(int, 1, strict=False), default=3, help="SGD steps of the correctness check"
    )
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--timeout-s", type=number_arg(float, 0), default=600.0, help="a rank waiting longer fails")
    # tests only: a transport made slow, or one losing a pair's adds, on purpose
    p.add_argument("--test-delay-s", type=number_arg(float, 0, strict=False), default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--test-lossy-pair", metavar="S:O", help=argparse.SUPPRESS)
    return p


def _options(p: argparse.ArgumentParser, args, device: str, world_size: int) -> CheckOptions:
    if args.json and os.path.isdir(args.json):
        p.error(f"--json {args.json} is a directory; name a file")
    model = args.model or DEFAULT_MODEL[device]
    try:
        LayerShape.of(model)
    except ValueError as e:
        p.error(f"--model: {e}")
    lossy = None
    if args.test_lossy_pair:
        try:
            lossy = tuple(int(x) for x in args.test_lossy_pair.split(":"))
        except ValueError:
            lossy = ()
        if len(lossy) != 2 or not all(0 <= r < world_size for r in lossy) or lossy[0] == lossy[1]:
            p.error(f"--test-lossy-pair must be SENDER:OWNER, two different ranks below {world_size}")
    return CheckOptions(device, model, args.micro_batch_tokens, args.steps, args.timeout_s, args.test_delay_s, lossy)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.ranks is not None and not args.cpu:
        p.error("--ranks goes with --cpu (on GPUs: --gpus N)")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not (args.cpu or args.gpus)
    if under_torchrun:
        return _run_under_torchrun(p, args)
    if args.cpu:
        ranks = args.ranks or 2
        options = _options(p, args, "cpu", ranks)
        backend = "gloo"
    elif args.gpus:
        import torch

        if not torch.cuda.is_available():
            p.error("--gpus needs CUDA GPUs; on CPU use --cpu")
        options, ranks = _options(p, args, "cuda", args.gpus), args.gpus
        # NCCL takes one rank per GPU: ranks sharing a GPU meet over gloo, and the collectives compared are gloo's
        backend = "nccl" if torch.cuda.device_count() >= ranks else "gloo"
    else:
        p.error("say where to run: --gpus N, --cpu [--ranks N], or launch it with torchrun -m odc_plugin.check")
    from ..launch import RankFailed, run_ranks

    try:
        report = run_ranks(check_rank, ranks, options, timeout_s=args.timeout_s * 4, backend=backend)[0]
    except RankFailed as e:
        print(f"odc-check: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return _finish(report, options, args.json)


def _run_under_torchrun(p: argparse.ArgumentParser, args) -> int:
    import torch
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = _options(p, args, device, int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    report = check_rank(dist.get_rank(), dist.get_world_size(), options)
    return _finish(report, options, args.json) if dist.get_rank() == 0 else int(not _passed(report))


def _passed(report: dict) -> bool:
    return any(r["passed"] for r in report["probe"].values()) and report.get("correctness", {}).get("passed", False)


def _verdict(report: dict, options: CheckOptions) -> Verdict | None:
    if "memory" not in report:
        return None
    c, shape = report["calibration"], LayerShape.of(options.model)
    compute_s = shape.forward_flops(options.micro_batch_tokens) / report["compute"]["flops_per_s"]
    overhead = balanced_overhead(
        compute_s, (c.gather_s, c.accumulate_s[c.chosen]), (c.all_gather_s, c.reduce_scatter_s)
    )
    try:
        planned = planned_speedup(shape, report["ranks"], report["compute"]["flops_per_s"])
    except ImportError:  # the planner's LB-Micro is verl's own balancing
        planned = None
    report["verdict_inputs"] = {"compute_s_per_layer": compute_s, "planned": planned}
    return Verdict(c.ratio, c.backend, overhead, planned)


def _finish(report: dict, options: CheckOptions, json_path: str | None) -> int:
    verdict = _verdict(report, options)
    lines = format_report(report, options, verdict)
    print("\n".join(lines))
    if json_path:
        data = {**report, "verdict": dataclasses.asdict(verdict) | {"line": verdict.line()} if verdict else None}
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1, default=_plain)
    return 0 if _passed(report) else 1


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def format_report(report: dict, options: CheckOptions, verdict: Verdict | None) -> list[str]:
    """The screen: every figure from `report`, measured in this run."""
    env, ranks = report["environment"], report["ranks"]
    where = f"{ranks} {'GPU' if options.device == 'cuda' else 'CPU'} ranks"
    lines = [f"odc-check: {where}, ODC over {report['transport']}, collectives over {report['backend']}", "environment"]
    lines.append(
        f"  torch {env['torch']}, CUDA {env['cuda'] or 'none'}, NCCL {env['nccl'] or 'none'}, Triton "
        f"{env['triton'] or 'none'}, verl {env['verl'] or 'none'}; Python {env['python']}; {env['platform']}"
    )
    lines.append(f"  CPU {env['cpu']}, {env['cores']} cores; GPUs: {', '.join(env['gpus']) or 'none'}")
    if options.device == "cuda" and report["backend"] != "nccl":
        lines.append(
            "  NCCL unavailable: ranks share a GPU (NCCL takes one rank per GPU); compared with gloo's collectives"
        )
    lines += [f"  links: {row}" for row in env["gpu_links"]]
    if report.get("start_probe_fallback"):
        lines.append(
            "  peer atomics failed the transport's start-up check, so it adds through slots: "
            + report["start_probe_fallback"]
        )
    for method, probe in report["probe"].items():
        result = f"exact, {probe['seconds'] * 1e3:.0f} ms" if probe["passed"] else f"FAILED: {probe['error']}"
        lines.append(f"  start-up check of peer adds, method '{method}': {result}")
    if "calibration" in report:
        c, layer = report["calibration"], report["layer"]
        lines.append(
            f"transport against {c.backend}'s collectives, one decoder layer of {layer['model']} "
            f"({layer['params'] / 1e6:.1f}M parameters, {layer['shard'] / 1e6:.2f}M a rank), slowest rank"
        )
        gbps = lambda nbytes, s: f"{nbytes * (ranks - 1) / s / 1e9:.1f} GB/s"  # noqa: E731  (what each rank moves)
        lines.append(
            f"  gather     {c.gather_s * 1e3:8.2f} ms ({gbps(c.gather_bytes, c.gather_s)})   all-gather     "
            f"{c.all_gather_s * 1e3:8.2f} ms ({gbps(c.gather_bytes, c.all_gather_s)})   ratio {c.gather_ratio:.2f}x"
        )
        for method, seconds in c.accumulate_s.items():
            chosen = " (chosen)" if method == c.chosen else ""
            lines.append(
                f"  accumulate {method:<7}{seconds * 1e3:8.2f} ms ({gbps(c.reduce_bytes, seconds)})   reduce-scatter "
                f"{c.reduce_scatter_s * 1e3:8.2f} ms ({gbps(c.reduce_bytes, c.reduce_scatter_s)})   ratio "
                f"{c.accumulate_ratio(method):.2f}x{chosen}"
            )
        lines += [f"  {method} not eligible: {why}" for method, why in c.excluded.items()]
        lines.append("  ratios are the collective's time over ODC's: above 1, ODC's transport is faster")
    if "correctness" in report:
        k = report["correctness"]
        lines.append(
            f"correctness: Qwen2 '{k['model']}', {k['steps']} SGD steps, ODC on micro-batch counts "
            f"{k['odc_micro_batches']} against stock FSDP2 on {k['fsdp_micro_batches']}"
        )
        lines.append(
            f"  worst relative difference of the parameters' updates: {k['worst']:.2e} (limit {k['limit']:.0e}): "
            + ("same training" if k["passed"] else "FAILED: ODC trains otherwise than FSDP2 here")
        )
    if "compute" in report:
        m = report["compute"]
        kept = m.get("kept_beside_accumulates")
        lines.append(
            f"compute: {m['dtype']} matmul {m['size']}^3 at {m['flops_per_s'] / 1e12:.2f} TFLOP/s (slowest rank)"
            + (f"; keeps {kept:.2f} of it with the accumulates running beside it" if kept is not None else "")
        )
    if "memory" in report:
        mem = report["memory"]
        lines.append(
            f"memory: ODC holds {_mib(mem['odc_built_bytes'])} while built, {_mib(mem['odc_released_bytes'])} once "
            "released (its control words, as the allocator holds them)"
        )
        if "fsdp2" in mem:
            o, f = mem["odc"], mem["fsdp2"]
            for key in ("allocated", "reserved", "driver"):
                if f[key] >= 0:
                    lines.append(
                        f"  after offload, {key:<9} ODC {_mib(o[key])}, FSDP2 {_mib(f[key])} "
                        f"({(o[key] - f[key]) / max(f[key], 1):+.2%})"
                    )
    if "all_to_all" in report:
        lines += _all_to_all_lines(report["all_to_all"], options)
    if verdict is not None:
        inputs = report["verdict_inputs"]
        lines.append(
            f"verdict: a layer's forward of {options.micro_batch_tokens} tokens computes in "
            f"{inputs['compute_s_per_layer'] * 1e3:.2f} ms here"
            + ("" if inputs["planned"] else "; the planner needs verl (pip install verl==0.9.1): not predicted")
        )
        lines.append(verdict.line())
    elif not _passed(report):
        lines.append("odc-check: FAILED: see above; strategy=odc would not train correctly on this machine")
    return lines


def _all_to_all_lines(a: AllToAllCalibration | str, options: CheckOptions) -> list[str]:
    """odc_split's all-to-all: per group size the measured points and the line through them, and the engine
    settings that give the planner the slowest of them."""
    if isinstance(a, str):
        return [f"Ulysses all-to-all (odc_split): not measured: {a}"]
    sizes = ", ".join(str(k) for k in a.group_sizes)
    lines = [
        f"Ulysses all-to-all (odc_split) over {a.backend}, aligned groups of {sizes} ranks at once, "
        f"{options.micro_batch_tokens} tokens a rank of {options.model}; slowest rank, median of {a.repeats}"
    ]
    for k in a.group_sizes:
        points = ", ".join(f"{_mib(b)} {t * 1e3:.3f} ms" for b, t in zip(a.message_bytes, a.seconds[k]))
        lines.append(
            f"  k={k:<2} latency {a.latency_s[k] * 1e6:9.1f} us   bandwidth {a.bandwidth[k] / 1e9:8.2f} GB/s   "
            f"({points})"
        )
    lines.append(
        "  for the planner (the smallest bandwidth and largest latency above): "
        f"odc_split_bandwidth={a.worst_bandwidth:.3e} odc_split_latency_s={a.worst_latency_s:.3e}"
    )
    lines.append(
        "  (engine.odc_split_* in verl's SFT trainer, <role's engine config>.odc_split_* in main_ppo; unset, the "
        f"planner models {NVLINK_BW:.3e} bytes/s and {A2A_LATENCY_S:.3e} s)"
    )
    return lines


def entry() -> None:
    sys.exit(main())
