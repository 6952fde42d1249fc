"""Predict mini-batch time and idle under FSDP+LB-Micro, ODC+LB-Micro, ODC+LB-Mini and ODC+LB-Mini+split
(`odc-plan`).

FSDP's per-layer collectives make ranks move in lockstep: every micro-batch step lasts as long as its
slowest rank. Under ODC a rank only waits at the end of the mini-batch, so a mini-batch lasts as long
as the slowest rank's own sum. Work outside the micro-batch loop (optimizer step, final gradient
reduction) is the same in all three and left out.

    odc-plan --lengths rl --cost flops --model Qwen2.5-7B
    odc-plan --lengths ~/data/math/train.parquet:prompt --tokenizer MODEL_DIR --model MODEL_DIR
    odc-plan --lengths ROLLOUT_DATA_DIR --tokenizer MODEL_DIR --ranks 8 --minibatch-sizes 1280
    odc-plan --lengths run.jsonl --ranks 8 --minibatch-sizes 1280 --micro-batch-size 16
    odc-plan --cost fit --fit-file configs/cost_fit/Qwen2.5-7B-H100.json
    odc-plan --sp 2 4 --lengths rl --max-response-length 32768 --ranks 8 32
    odc-plan --lengths agent --max-prompt-length 2048 --max-response-length 16384 --trainer-mode sync separate_async

Lengths (`--lengths`): a profile (`rl`, `sft`); a verl data set's prompt column with the model's tokenizer
(prompts counted with its chat template, responses drawn as `rl` draws them); what a verl run wrote, planned
step by step: its rollout dumps (`trainer.rollout_data_dir`, with `--tokenizer`) or its metrics file
(`trainer.logger=[...,file]`: each step's logged prompt and response lengths); or a file of lengths.
`--model` is a preset or a model directory's config.json: the `flops` cost is then verl's FlopsCounter for
any architecture verl knows (odc_plugin.balance.costs.flops_cost).

With Ulysses sequence parallelism (`--sp N`, verl's `ulysses_sequence_parallel_size`) the unit that
FSDP holds in lockstep and LB-Mini balances is a group of N GPUs: ranks / N groups, each computing its
samples N times as fast (heads split over the group; the all-to-all is not modelled), each packing
micro-batches to N times the per-GPU token budget, as verl does.

ODC+LB-Mini+split (odc_plugin.balance.split) is LB-Mini with a mini-batch's longest samples each split
over a Ulysses group of k GPUs inside a node, k a power of two that --model's attention heads allow; its
all-to-alls are modelled from --model's shapes at --intra-node-bw, not measured (the model's heads and
shapes are Qwen2.5-7B's unless --model names another). Its limit is its own: the longest sample no longer
bounds it whole, only over the largest group. The engines run it with `odc_split=auto`.

Across nodes (`--nodes`), it compares FSDP2's HSDP with LB-Micro (verl's `fsdp2` with `fsdp_size` = GPUs
per node) and ODC inside each node with one all-reduce across nodes per mini-batch (`odc` with the same
`fsdp_size`), and picks the faster; it also shows flat ODC over all ranks through NVSHMEM, which this
version refuses (its best case, for when it is enabled), never picking it:

    odc-plan --nodes 2 4 8 --lengths rl --model Qwen2.5-7B
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from importlib import resources

from odc_plugin.balance.costs import PRESETS, CostCalibration, CostModel, FitCost, VerlFlopsCost, get_cost_model
from odc_plugin.balance.lengths import LengthSource, plan_lengths
from odc_plugin.balance.modes import MODES
from odc_plugin.balance.plan_report import end_to_end, format_table, plot, print_cluster, step_times_of
from odc_plugin.balance.rollout_time import DecodeModel
from odc_plugin.balance.split import UlyssesModel
from odc_plugin.balance.step_time import (
    IB_BW,
    NVLINK_BW,
    SPEEDUP_BASELINE,
    ClusterModel,
    StepTimeModel,
    cluster_table,
    model_params,
    plan_table,
)
from odc_plugin.cli_args import number_arg

DEFAULT_RANKS = [8, 16, 32, 64]
DEFAULT_MODEL = "Qwen2.5-7B"


POSITIVE_INT, POSITIVE, NON_NEGATIVE = number_arg(int), number_arg(float), number_arg(float, strict=False)


def _parser() -> argparse.ArgumentParser:
    """odc-plan's arguments; long because it is one add_argument per option."""
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="odc-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--lengths",
        default="rl",
        help="rl, sft, agent (multi-turn tool trajectories), a verl data set's DATA.parquet:prompt (with "
        "--tokenizer), a verl rollout dump directory (trainer.rollout_data_dir, with --tokenizer), verl's metrics "
        "file (file logger, .jsonl), or "
        "FILE.json / FILE.txt / FILE.parquet:COLUMN of lengths or token ids",
    )
    p.add_argument(
        "--tokenizer",
        metavar="MODEL_DIR",
        help="count the tokens of a data set's chat prompts (a vision-language set's images by this model's image "
        "processor) or of a rollout dump with this model's tokenizer",
    )
    p.add_argument("--ranks", type=POSITIVE_INT, nargs="+", help=f"GPUs; default {' '.join(map(str, DEFAULT_RANKS))}")
    p.add_argument(
        "--sp",
        type=POSITIVE_INT,
        nargs="+",
        metavar="N",
        help="Ulysses sequence-parallel sizes (ulysses_sequence_parallel_size); rows per size; default 1",
    )
    p.add_argument(
        "--minibatch-sizes",
        type=POSITIVE_INT,
        nargs="+",
        help="samples per mini-batch (ppo_mini_batch_size x rollout.n); default 256 512 1024, for a run's "
        "lengths its step",
    )
    p.add_argument("--max-token-len", type=POSITIVE_INT, help="ppo_max_token_len_per_gpu; default max(16384, longest)")
    p.add_argument(
        "--micro-batch-size",
        type=POSITIVE_INT,
        metavar="N",
        help="ppo_micro_batch_size_per_gpu: fixed micro-batches of N samples instead of dynamic batch size",
    )
    p.add_argument("--cost", default="flops", choices=["tokens", "flops", "fit"])
    p.add_argument(
        "--model",
        help=f"for --cost flops (and --nodes' parameters): a preset ({', '.join(PRESETS)}) or a model directory "
        f"with a config.json; default {DEFAULT_MODEL}",
    )
    p.add_argument(
        "--moe-flops",
        choices=["active", "total"],
        help="for --cost flops with an MoE model: a token's cost through its own experts (active, the default: "
        "what it costs) or through all of them (total, as a dense model of that size)",
    )
    p.add_argument("--fit-a", type=NON_NEGATIVE, help="for --cost fit: a in a*s^2 + b*s")
    p.add_argument("--fit-b", type=NON_NEGATIVE, help="for --cost fit: b in a*s^2 + b*s")
    p.add_argument(
        "--fit-file",
        metavar="FILE.json",
        help="for --cost fit, instead of --fit-a/--fit-b: benchmarks/calibrate_cost.py's per-layer fit, "
        "times --num-layers (default: the layers of the file's model)",
    )
    p.add_argument(
        "--throughput", type=POSITIVE, help="cost units per second; default 4e14 for flops (H100, ~40%% MFU), else 1"
    )
    p.add_argument(
        "--layer-comm-bytes",
        type=NON_NEGATIVE,
        help="per layer and micro-batch (not with --nodes); default 0: compute only",
    )
    p.add_argument("--num-layers", type=POSITIVE_INT, help="default: the model's for --cost flops and --fit-file")
    p.add_argument(
        "--intra-node-bw",
        type=POSITIVE,
        default=NVLINK_BW,
        help="bytes/s per GPU and direction inside a node (default: ~80%% of H100 NVLink 4)",
    )
    p.add_argument(
        "--inter-node-bw",
        type=POSITIVE,
        default=IB_BW,
        help="bytes/s per GPU and direction across nodes (default: ~80%% of one 400 Gb/s IB NIC)",
    )
    p.add_argument("--gpus-per-node", type=POSITIVE_INT, default=8)
    p.add_argument(
        "--nodes",
        type=POSITIVE_INT,
        nargs="+",
        help="compare FSDP-HSDP, ODC-HSDP and flat ODC on these node counts (instead of --ranks)",
    )
    p.add_argument("--model-params", type=POSITIVE, help="for --nodes: parameters to communicate; default --model's")
    p.add_argument("--max-prompt-length", type=POSITIVE_INT, default=512, help="for --lengths rl")
    p.add_argument(
        "--max-response-length",
        type=POSITIVE_INT,
        default=4096,
        help="for --lengths rl and a data set's prompts' responses",
    )
    p.add_argument("--max-length", type=number_arg(int, 2, strict=False), default=32768, help="for --lengths sft")
    p.add_argument(
        "--length-factor",
        type=POSITIVE_INT,
        default=1,
        metavar="K",
        help="each token of the lengths stands for K (an emulated rehearsal's run, odc-grpo-cpu --length-factor)",
    )
    p.add_argument(
        "--draws", type=POSITIVE_INT, help="mini-batches averaged per row; default 5, for a run's lengths its steps"
    )
    p.add_argument(
        "--fsdp-shares",
        choices=["balanced", "sampler"],
        help="FSDP's rank shares: balanced (the default: verl's PPO trainer, its Ray SFT trainer) or sampler "
        "(verl's torchrun SFT trainer: each rank its own sampler's)",
    )
    p.add_argument(
        "--trainer-mode",
        choices=MODES,
        nargs="+",
        help="also predict verl's step end to end in these trainer modes: from a run's metrics file (--lengths "
        "RUN.jsonl) its own timing_s/* (give the one mode it ran in), else modelled (the rollout by --rollout-fit)",
    )
    p.add_argument(
        "--rollout-fit",
        metavar="FILE.json",
        help="for a modelled --trainer-mode: the inference server's decode fit (odc_plugin.balance.rollout_time; "
        f"default for {DEFAULT_MODEL}: configs/cost_fit/Qwen2.5-7B-H100-decode.json)",
    )
    p.add_argument("--seed", type=number_arg(int, strict=False), default=0)
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also plot speedup and idle fraction")
    return p


def _cost_and_model(args) -> tuple[CostModel, StepTimeModel]:
    """The cost model and the step-time model the arguments ask for; ValueError names what is wrong."""
    num_layers = args.num_layers
    if args.cost == "fit" and args.fit_file:
        calibration = CostCalibration.load(args.fit_file)
        if num_layers is None:
            num_layers = calibration.num_hidden_layers
        if not num_layers:
            raise ValueError(f"{args.fit_file}: model {calibration.model!r} is not a preset; give --num-layers")
        # Whole-model seconds per sequence, as --fit-a/--fit-b give them, so the throughput stays 1.
        cost = FitCost(calibration.a * num_layers, calibration.b * num_layers)
    else:
        cost = get_cost_model(
            args.cost,
            **{"flops": {"model": args.model}, "fit": {"a": args.fit_a, "b": args.fit_b}}.get(args.cost, {}),
        )
        if args.moe_flops == "total" and hasattr(cost, "dense"):
            cost = cost.dense()
    throughput = args.throughput
    if throughput is None:
        throughput = 4e14 if args.cost == "flops" else 1.0
    model = StepTimeModel(
        throughput=throughput,
        layer_comm_bytes=0.0 if args.layer_comm_bytes is None else args.layer_comm_bytes,
        num_layers=getattr(cost, "num_hidden_layers", 0) if num_layers is None else num_layers,
        intra_node_bw=args.intra_node_bw,
        inter_node_bw=args.inter_node_bw,
        gpus_per_node=args.gpus_per_node,
    )
    return cost, model


def _check_combination(p: argparse.ArgumentParser, args) -> None:
    """Refuse an option the others leave unused (none is silently ignored), then fill in the defaults that
    depend on which options were given."""
    if args.nodes:
        given = {
            "--ranks": args.ranks,
            "--sp": args.sp,
            "--plot": args.plot,
            "--layer-comm-bytes": args.layer_comm_bytes,
            "--fsdp-shares": args.fsdp_shares,
            "--trainer-mode": args.trainer_mode,
        }
        unused = [option for option, value in given.items() if value is not None]
        if unused:
            p.error(
                f"{', '.join(unused)}: not used with --nodes, which plans nodes x --gpus-per-node GPUs and models "
                "their communication from --model-params; drop them or --nodes"
            )
    elif args.model_params is not None:
        p.error("--model-params is for --nodes; drop it or give --nodes")
    given = {"--fit-a": args.fit_a, "--fit-b": args.fit_b, "--fit-file": args.fit_file}
    fit_options = [option for option, value in given.items() if value is not None]
    if args.cost != "fit" and fit_options:
        p.error(f"{', '.join(fit_options)}: for --cost fit, not --cost {args.cost}; give --cost fit or drop them")
    if args.cost == "fit" and args.fit_file and (args.fit_a is not None or args.fit_b is not None):
        p.error("--cost fit takes --fit-file or --fit-a and --fit-b, not both")
    if args.cost == "fit" and not args.fit_file and (args.fit_a is None or args.fit_b is None):
        p.error("--cost fit needs --fit-file, or --fit-a and --fit-b")
    if args.cost != "flops" and args.moe_flops is not None:
        p.error(f"--moe-flops is for --cost flops, not --cost {args.cost}; drop it")
    if args.cost != "flops" and args.model is not None and not (args.nodes and args.model_params is None):
        p.error(f"--model is for --cost flops (or --nodes without --model-params), not --cost {args.cost}; drop it")
    if args.trainer_mode and args.json:
        p.error("--trainer-mode prints its end-to-end lines as text; drop --json or --trainer-mode")
    if args.rollout_fit is not None and not args.trainer_mode:
        p.error("--rollout-fit is for a modelled --trainer-mode; give --trainer-mode or drop it")
    if args.model is None:
        args.model = DEFAULT_MODEL
    if args.trainer_mode and args.rollout_fit is None and args.model == DEFAULT_MODEL:
        args.rollout_fit = str(resources.files("odc_plugin.configs") / "cost_fit" / "Qwen2.5-7B-H100-decode.json")
    if args.ranks is None:
        args.ranks = DEFAULT_RANKS
    if args.sp is None:
        args.sp = [1]
    if args.plot is not None:
        if len(args.sp) > 1:
            p.error("--plot draws one sequence-parallel size; give one --sp")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            p.error(f"--plot {args.plot}: no directory {folder}; create it or give another path")


def _lengths(args) -> LengthSource:
    """The lengths the arguments name; fills in the defaults that depend on them (a run's mini-batch is its
    step, its draws are its steps)."""
    source = plan_lengths(
        args.lengths,
        tokenizer=args.tokenizer,
        max_prompt_length=args.max_prompt_length,
        max_response_length=args.max_response_length,
        max_length=args.max_length,
    )
    if args.length_factor > 1:
        k, draw = args.length_factor, source.draw
        source = replace(
            source,
            draw=lambda n, seed: [k * s for s in draw(n, seed)],
            longest=k * source.longest,
            what=f"{source.what}, each token standing for {k}",
        )
    if args.minibatch_sizes is None:
        args.minibatch_sizes = [source.step_samples] if source.steps and source.step_samples else [256, 512, 1024]
    if args.draws is None:
        args.draws = source.steps or 5
    return source


def _cost_text(args, cost: CostModel) -> str:
    """The cost model, saying which FLOPs formula counts the model."""
    if isinstance(cost, VerlFlopsCost):
        return f"flops (verl's FlopsCounter, model_type {cost.model_type}, {args.model})"
    if args.cost == "flops":
        return f"flops (odc_plugin's own formula: verl's FlopsCounter does not know {args.model})"
    return args.cost


def _print_table(args, source: LengthSource, cost: str, rows, max_token_len: int, throughput: float) -> None:
    batching = (
        f"micro_batch_size={args.micro_batch_size}" if args.micro_batch_size else f"max_token_len={max_token_len}"
    )
    if args.json:
        rows_json = [asdict(r) | {"speedup": {s: r.speedup(s) for s in r.seconds}} for r in rows]
        header = {"lengths": args.lengths, "lengths_from": source.what, "cost": args.cost, "cost_model": cost}
        header["speedup_baseline"] = SPEEDUP_BASELINE  # every row's "speedup" is over this scheme's time
        header["fsdp_shares"] = args.fsdp_shares or "balanced"
        batch = {"max_token_len": max_token_len, "micro_batch_size": args.micro_batch_size}
        print(json.dumps({**header, **batch, "rows": rows_json}))
        return
    print(f"lengths: {source.what}")
    print(f"cost={cost} {batching} draws={args.draws}; time = cost / {throughput:g} per second")
    if args.fsdp_shares == "sampler":
        print("FSDP+LB-Micro: each rank trains its own sampler's share (verl's torchrun SFT trainer), unbalanced")
    if any(sp > 1 for sp in args.sp):
        print(
            "sp: Ulysses group size; 'per rank' is then per group, whose micro-batches hold sp x max_token_len tokens"
        )
    print(format_table(rows))


def main(argv: Sequence[str] | None = None) -> None:
    """odc-plan: check the arguments, build the table (per rank count, or per node count) and print it; long because it
    is the CLI's steps in order, each a few lines.
    """
    p = _parser()
    args = p.parse_args(argv)
    _check_combination(p, args)
    left_out: list[str] = []  # the configurations verl could not run, with why
    try:
        cost, model = _cost_and_model(args)
        source = _lengths(args)
        timed = step_times_of(args.lengths, source, args.trainer_mode) if args.trainer_mode else {}
        decode = None
        if args.trainer_mode and not timed:
            if args.rollout_fit is None:
                raise ValueError(f"a modelled --trainer-mode needs --rollout-fit FILE.json for {args.model}")
            decode = DecodeModel.load(args.rollout_fit)
        max_token_len = max(16384, source.longest) if args.max_token_len is None else args.max_token_len
        if args.nodes:
            cluster = ClusterModel(
                model_params(args.model) if args.model_params is None else args.model_params,
                args.gpus_per_node,
                args.intra_node_bw,
                args.inter_node_bw,
            )
            rows = cluster_table(
                source.draw,
                args.nodes,
                args.minibatch_sizes,
                max_token_len,
                cost,
                cluster,
                model.throughput,
                args.draws,
                args.seed,
                micro_batch_size=args.micro_batch_size,
                skipped=left_out,
            )
        else:
            rows = plan_table(
                source.draw,
                args.ranks,
                args.minibatch_sizes,
                max_token_len,
                cost,
                model,
                args.draws,
                args.seed,
                args.sp,
                micro_batch_size=args.micro_batch_size,
                skipped=left_out,
                ulysses=UlyssesModel.from_config(args.model, args.gpus_per_node, args.intra_node_bw),
                balance_ranks=args.fsdp_shares != "sampler",
            )
    except ValueError as e:
        p.error(str(e))
    if not rows:
        over = "node count's GPUs (nodes x --gpus-per-node)" if args.nodes else "rank count"
        per_rank = f" into micro-batches of {args.micro_batch_size}" if args.micro_batch_size else ""
        p.error(f"no mini-batch size divides evenly over any {over}{per_rank}; give --minibatch-sizes that do")
    if left_out:
        print(f"odc-plan: note: left out, as verl could not run them: {'; '.join(left_out)}", file=sys.stderr)
    if args.nodes:
        print_cluster(
            rows,
            cluster,
            lengths=source.what,
            cost=_cost_text(args, cost),
            draws=args.draws,
            max_token_len=max_token_len,
            throughput=model.throughput,
            as_json=args.json,
        )
        return
    _print_table(args, source, _cost_text(args, cost), rows, max_token_len, model.throughput)
    if args.trainer_mode:
        print("\n" + end_to_end(args.trainer_mode, rows, timed, source, args.draws, args.seed, decode))
    if args.plot:
        plot(rows, args.plot, title=f"{args.lengths}, cost={args.cost}, max_token_len={max_token_len}")


if __name__ == "__main__":
    main()
