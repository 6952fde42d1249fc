"""The `odc-demo` command: one run of the four rows, or a sweep over rank counts with emulated compute."""

from __future__ import annotations

import argparse

from ..layer_time import time_scale_arg
from ..models import MODEL_SIZES
from .config import COSTS, DEFAULT_RANKS, SAMPLES_PER_RANK, WORKLOADS, DemoConfig
from .run import run_demo
from .sweep import case_config, run_sweep

SINGLE_STEPS, SWEEP_STEPS = 8, 6


def _parser() -> argparse.ArgumentParser:
    """odc-demo's arguments; long because it is one add_argument per option."""
    defaults = DemoConfig(ranks=2)
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="odc-demo",
        description="Four A/B rows of real FSDP2 and ODC training on CPU "
        "processes, and what each step between them buys.",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=DEFAULT_RANKS,
        help=f"CPU rank processes (default {DEFAULT_RANKS}: this machine's cores, at least 2)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help=f"timed mini-batches per row (default {SINGLE_STEPS}; {SWEEP_STEPS} per point of a sweep)",
    )
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), help="default small ('stand-in' with --emulate)")
    p.add_argument("--workload", choices=WORKLOADS, help="default rl; a sweep runs both unless one is named")
    p.add_argument("--lengths", default=None, help="sample lengths: JSON list, text file, or file.parquet:column")
    p.add_argument(
        "--mini-batch-size",
        type=int,
        default=None,
        help=f"prompts (rl) or samples (sft) per mini-batch; default {SAMPLES_PER_RANK} samples per rank (rl: "
        f"{SAMPLES_PER_RANK // defaults.group_size} prompts of {defaults.group_size} responses per rank)",
    )
    p.add_argument("--max-prompt-length", type=int, default=defaults.max_prompt_length, help="rl")
    p.add_argument("--max-response-length", type=int, default=defaults.max_response_length, help="rl")
    p.add_argument("--max-token-len", type=int, default=defaults.max_token_len)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out-dir", default=defaults.out_dir)
    p.add_argument(
        "--emulate",
        metavar="FIT.json",
        help="emulate each decoder layer's compute from this GPU cost fit (benchmarks/calibrate_cost.py, "
        "e.g. configs/cost_fit/Qwen2.5-7B-H100.json); everything else stays real",
    )
    p.add_argument(
        "--time-scale",
        type=time_scale_arg,
        help="emulated seconds = the fit's seconds times X (default 'auto': a rank's fair share of a "
        "mini-batch takes about 5 s, which keeps the rehearsal's own overhead small)",
    )
    p.add_argument(
        "--stand-in",
        type=int,
        help="with --emulate the model computes on sequences this many times shorter than the true ones (default 64)",
    )
    p.add_argument(
        "--slow-ranks",
        metavar="R:F[,R:F]",
        help="rank R's layer compute takes F times as long (emulated, or measured without --emulate)",
    )
    p.add_argument(
        "--cost",
        choices=COSTS,
        default="fit",
        help="auto: a fifth row, odc+lb_mini_auto, whose LB-Mini cost is fitted from the micro-batch "
        "times it measures, each rank's speed included",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="a row more, odc+lb_mini+split: LB-Mini with a mini-batch's longest samples split over Ulysses "
        "groups of ranks where that is predicted faster",
    )
    p.add_argument(
        "--sweep-ranks",
        type=int,
        nargs="+",
        metavar="N",
        help="with --emulate: run the rl and sft cases (odc_plugin/demo/sweep.py) at each rank count; "
        "writes odc_sweep.json and odc_sweep.png",
    )
    return p


def main(argv=None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    sweep = args.sweep_ranks is not None
    if sweep and not args.emulate:
        p.error("--sweep-ranks runs many ranks on this machine's cores: it needs --emulate FIT.json")
    if sweep and min(args.sweep_ranks) < 1:
        p.error(f"--sweep-ranks: every rank count must be >= 1, got {min(args.sweep_ranks)}")
    workloads = [args.workload] if args.workload or not sweep else list(WORKLOADS)
    try:
        base = DemoConfig(
            ranks=max(args.sweep_ranks) if sweep else args.ranks,
            steps=(SWEEP_STEPS if sweep else SINGLE_STEPS) if args.steps is None else args.steps,
            model_size=args.model_size,
            workload=workloads[0] or "rl",
            lengths=args.lengths,
            mini_batch_size=args.mini_batch_size,
            max_prompt_length=args.max_prompt_length,
            max_response_length=args.max_response_length,
            max_token_len=args.max_token_len,
            seed=args.seed,
            out_dir=args.out_dir,
            emulate=args.emulate,
            time_scale=args.time_scale,
            stand_in=args.stand_in,
            slow_ranks=args.slow_ranks,
            cost=args.cost,
            split=args.split,
        )
        for workload in workloads if sweep else ():  # every point is checked before the first one runs
            for n in args.sweep_ranks:
                case_config(base, workload, n)
    except ValueError as e:
        p.error(str(e))
    if sweep:
        run_sweep(base, args.sweep_ranks, workloads)
    else:
        run_demo(base)
