"""`odc-grpo-cpu`: verl's real GRPO trainer (`python -m verl.trainer.main_ppo`) on this machine's CPU,
once with `strategy=fsdp2` and once with `strategy=odc` (or the runs `--compare` names), same seed,
data and settings, then the A/B report of the runs.

    odc-grpo-cpu [--steps N] [--out DIR] [--model qwen2|qwen3_moe|qwen2_5_vl] [--slow-ranks R:F] [key=value ...]
    odc-grpo-cpu --emulate FIT.json [--ranks N] [--compare fsdp2,lockstep,odc] [--time-scale X|auto] ...

With `--emulate` the trainer runs at the scale ODC is for: every decoder layer's compute is emulated from
a GPU cost fit (odc_plugin.layer_time; each real token stands for `--length-factor` true ones), each
response is really generated to a length drawn from the rl profile of odc-demo's sweep, one prompt of
4 responses per rank, and the report gives per FSDP phase the idle fraction and the planner's prediction
for the plans each run ran (emulation.py).

Each `key=value` goes to every run as a hydra override (e.g. actor_rollout_ref.actor.use_dynamic_bsz=False),
except the odc engine's options (README, Options: `actor_rollout_ref.actor.fsdp_config.odc_transport=shm`, ...),
which go to the runs of strategy odc only, and the keys odc-grpo-cpu sets itself (strategy, steps, logger,
...), which are refused naming the option to use instead. All runs' configurations are composed and validated
by verl before any starts. Rollouts come from the `hf` rollout in deterministic mode, so the runs see
the same responses as long as their weights agree. Progress goes to the terminal; each run's full output
to DIR/<strategy>.log, its metrics to DIR/<strategy>.jsonl (verl's `file` logger), the report to DIR/report.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys

from ...cli_args import number_arg
from ...layer_time import AUTO_SHARE_S, auto_time_scale, parse_slow_ranks, time_scale_arg
from . import PLATFORM_ENV
from .assets import MODELS, ensure_assets
from .emulation import RL_LENGTHS, Emulation
from .grpo_config import (
    AUTO_RANKS,
    GROUP_SIZE,
    RUNS,
    STRATEGIES,
    ConfigRejected,
    harness_key_error,
    odc_option,
    run_args,
    settings,
    strategy_args,
    validate,
)
from .runner import RunResult, last_error, run_trainer


def _runs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"must be distinct runs out of {', '.join(RUNS)}, comma-separated (e.g. fsdp2,lockstep,odc), got {text!r}"
        )
    return names


def _parser() -> argparse.ArgumentParser:
    """odc-grpo-cpu's arguments; long because it is one add_argument per option."""
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="odc-grpo-cpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument("--out", default="odc_grpo_cpu", help="output directory (default ./odc_grpo_cpu)")
    parser.add_argument("--ranks", type=int, default=2, help="training ranks (CPU processes) per run (default 2)")
    parser.add_argument(
        "--compare",
        type=_runs,
        default=list(STRATEGIES),
        metavar="RUN,RUN,...",
        help="the runs, in order, out of fsdp2 (stock), lockstep (FSDP's per-layer synchronization on ODC's "
        "transport: the same-transport baseline), odc_lb_micro (ODC on verl's equal split), odc "
        "(ODC with LB-Mini) and split (odc with odc_split=auto); default fsdp2,odc",
    )
    parser.add_argument(
        "--timeout-s", type=number_arg(), default=1800.0, help="a run still going after this is killed (default 1800)"
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="qwen2",
        help="the tiny model trained (and the critic's, with a critic): a Qwen2, a Qwen3-MoE, or a Qwen2.5-VL "
        "(vision-language: verl's geo3k job on pictures of squares, with 0, 1 or several images a prompt)",
    )
    parser.add_argument(
        "--slow-ranks",
        metavar="R:F[,R:F]",
        help="training rank R's layers take F times as long, in every run (a slow GPU on purpose)",
    )
    parser.add_argument(
        "--emulate",
        metavar="FIT.json",
        help="emulate every decoder layer's compute from this GPU cost fit (e.g. configs/cost_fit/"
        "Qwen2.5-7B-H100.json) at odc-demo's rl case: one prompt of 4 responses per rank, response lengths "
        "drawn (--response-lengths); everything else stays real",
    )
    parser.add_argument(
        "--time-scale",
        type=time_scale_arg,
        help=f"with --emulate: emulated seconds = the fit's seconds times X (default 'auto': a rank's fair share "
        f"of an update's responses takes about {AUTO_SHARE_S:g} s per {AUTO_RANKS} ranks, which keeps the "
        "rehearsal's own overhead, growing with the processes that share the cores, a small part of a step)",
    )
    parser.add_argument(
        "--length-factor",
        type=int,
        help="each real token stands for this many true tokens, in emulated time and drawn lengths (default 64)",
    )
    parser.add_argument(
        "--response-lengths",
        metavar="rl|FILE",
        help="generate each response to a length drawn from this profile, in true tokens: 'rl' (odc-demo's "
        "sweep: median ~4.9k, up to 16384) or a lengths file; default rl with --emulate",
    )
    parser.add_argument(
        "--rollout-fit",
        metavar="FILE|none",
        help="with --emulate: hold each response until a GPU inference server would have generated it, by this "
        "decode fit (odc_plugin.balance.rollout_time; default: the fit's <name>-decode.json beside it, if there "
        "is one); 'none': the rollout takes the CPU's own time",
    )
    parser.add_argument(
        "--rollout-servers",
        type=int,
        help="with a rollout fit: the GPU inference servers the rollout stands for (default: one a training rank)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="hydra overrides for every run")
    return parser


def emulation_of(args, ranks: int) -> Emulation | None:
    """The runs' Emulation from the command line (checked: a bad fit or profile raises a one-line
    ValueError), its time scale resolved; None when nothing is emulated or drawn."""
    if args.emulate is None:
        for flag, value in (
            ("--time-scale", args.time_scale),
            ("--rollout-fit", args.rollout_fit),
            ("--rollout-servers", args.rollout_servers),
            ("--length-factor", args.length_factor),
        ):
            if value is not None and (flag != "--length-factor" or args.response_lengths is None):
                raise ValueError(
                    f"{flag} needs --emulate" + (" or --response-lengths" if flag == "--length-factor" else "")
                )
    if args.emulate is None and args.response_lengths is None:
        return None
    fit = os.path.abspath(args.emulate) if args.emulate else None
    emulation = Emulation(
        fit,
        length_factor=64 if args.length_factor is None else args.length_factor,
        response_lengths=args.response_lengths or RL_LENGTHS,
        rollout_fit=_rollout_fit(args.rollout_fit, fit),
        rollout_servers=ranks if args.rollout_servers is None else args.rollout_servers,
    )
    emulation.check()
    if fit is None:
        return emulation
    scale = "auto" if args.time_scale is None else args.time_scale
    if scale == "auto":
        # an update's mini-batch: GROUP_SIZE responses per rank, drawn as the rollout draws them
        draws = [
            [
                emulation.true_lengths([emulation.response_tokens(GROUP_SIZE * ranks * i + j)])[0]
                for j in range(GROUP_SIZE * ranks)
            ]
            for i in range(16)
        ]
        scale = auto_time_scale(fit, draws, ranks, AUTO_SHARE_S * max(1.0, ranks / AUTO_RANKS))
    return dataclasses.replace(emulation, time_scale=scale)


def _rollout_fit(given: str | None, fit: str | None) -> str | None:
    """The decode fit the rollout is held to: the one given, none, or the layer fit's -decode.json sibling."""
    if given is not None:
        return None if given == "none" else os.path.abspath(given)
    sibling = fit and os.path.splitext(fit)[0] + "-decode.json"
    return sibling if sibling and os.path.exists(sibling) else None


def save_emulation(emulation: Emulation | None, out_dir: str, run: str) -> None:
    """The run's own copy of the emulation (its passes recorded apart from the other runs'), saved as
    DIR/<run>.emulation.json."""
    if emulation is None:
        return
    passes = os.path.join(out_dir, f"{run}-passes")
    shutil.rmtree(passes, ignore_errors=True)  # a previous run's records would count as this one's
    os.makedirs(passes)
    path = os.path.join(out_dir, f"{run}.emulation.json")
    dataclasses.replace(emulation, passes_dir=passes if emulation.fit else None).save(path)


def describe(emulation: Emulation) -> str:
    lengths = (
        "the rl profile of odc-demo's sweep (median ~4.9k, up to 16384 true tokens)"
        if emulation.response_lengths == RL_LENGTHS
        else emulation.response_lengths
    )
    drawn = (
        f"responses: real generation by the hf rollout, each to a length DRAWN from {lengths}, "
        f"{emulation.length_factor} true tokens per real token"
    )
    if emulation.rollout_fit:
        drawn += (
            f", each held until {emulation.rollout_servers} GPU inference server(s) would have generated it "
            f"(decode MODELLED by {os.path.basename(emulation.rollout_fit)})"
        )
    fit = emulation.layer_fit()
    if fit is None:
        return drawn
    return (
        f"layer compute EMULATED from {fit.source}, time scale {fit.time_scale:.3g}, each real token standing for "
        f"{emulation.length_factor}; the rest real\n{drawn}"
    )


def report(results: list[RunResult], args, emulation: Emulation | None, out_dir: str) -> str:
    """The A/B report of the first run against the last, and with more runs or emulated ones, phase by phase."""
    from .. import ab_report
    from .emulation import phase_times, rollout_lateness

    runs = [ab_report.load_run(r.metrics_file, r.strategy, skip_first=1 if args.steps > 1 else 0) for r in results]
    text = ab_report.format_report(ab_report.compare(runs[0], runs[-1]))
    if "lockstep" not in args.compare:
        text += (
            "\non CPU the update phase also differs in transport (odc's shared-memory copies vs fsdp2's gloo): "
            "--compare fsdp2,lockstep,odc separates it"
        )
    if len(runs) < 3 and not (emulation and emulation.fit):
        return text
    times, label = {}, None
    if emulation and emulation.fit:
        slowdowns = parse_slow_ranks(args.slow_ranks, args.ranks)
        slowdowns = [slowdowns.get(r, 1.0) for r in range(args.ranks)]
        # the passes record a split micro-batch's whole lengths on every member: the split run's plans are
        # timed by the trainer's own planner instead (its odc_balance metrics)
        for r in (r for r in results if r.strategy != "split"):
            own = Emulation(
                **{**dataclasses.asdict(emulation), "passes_dir": os.path.join(out_dir, f"{r.strategy}-passes")}
            )
            times[r.strategy] = phase_times(
                own, own.passes_dir, r.steps, slowdowns, lockstep=r.strategy in ("fsdp2", "lockstep")
            )
        label = describe(emulation).splitlines()[0]
    memory = {r.strategy: r.peak_pss_gib for r in results}
    text += "\n\n" + ab_report.phase_report(runs, times, memory, label)
    for r in results if emulation and emulation.rollout_fit else ():
        held = rollout_lateness(os.path.join(out_dir, f"{r.strategy}-passes"))
        text += f"\nrollout of {r.strategy}: {held or 'no response recorded'}"
    return text + ("\n" + ab_report.split_prediction(runs[-1]) if "split" in args.compare else "")


def main(argv: list[str] | None = None) -> int:
    """odc-grpo-cpu: check every run's configuration, run them, report; long because it is the command's steps
    in order, each a few lines.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides are key=value, got {bad[0]!r}")
    harness = harness_key_error(args.overrides)
    if harness:
        parser.error(harness)
    odc = [o for o in args.overrides if odc_option(o)]
    if odc and all(RUNS[run][0] != "odc" for run in args.compare):
        parser.error(f"{odc[0]} is an odc engine option, but no run of --compare {','.join(args.compare)} is odc")
    out_dir = os.path.abspath(args.out)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        parser.error(f"--out {args.out} is a file: name a directory (created if missing)")
    try:
        parse_slow_ranks(args.slow_ranks, args.ranks)
        emulation = emulation_of(args, args.ranks)
    except ValueError as e:
        parser.error(str(e))

    os.environ[PLATFORM_ENV] = "cpu"  # for the configuration checks below, as in the runs
    assets = ensure_assets(model=args.model)
    shared = settings(assets, args.ranks, args.steps, out_dir, emulation)
    plan = {
        run: run_args(
            shared,
            run,
            args.overrides,
            os.path.join(out_dir, f"{run}.jsonl"),
            args.slow_ranks,
            os.path.join(out_dir, f"{run}.emulation.json") if emulation else None,
        )
        for run in args.compare
    }
    try:
        for run, run_plan in plan.items():
            validate(run_plan, run)
    except ConfigRejected as e:
        print(f"odc-grpo-cpu: {e}", file=sys.stderr)
        return 2
    # only now, so that a rejected command leaves nothing behind
    os.makedirs(out_dir, exist_ok=True)
    for run in args.compare:
        save_emulation(emulation, out_dir, run)

    first = args.compare[0]
    print(f"verl GRPO on CPU, {args.ranks} training ranks, {args.steps} steps per run; output in {out_dir}")
    if emulation:
        print(describe(emulation))
    command = shlex.join([sys.executable, "-m", "verl.trainer.main_ppo", *plan[first]])
    print(f"command ({first}):\n  {PLATFORM_ENV}=cpu {command}")
    for run in args.compare[1:]:
        differs = " ".join(strategy_args(run, args.overrides))
        print(f"the {run} run differs in: {differs} (and its experiment name and metrics file)")
    results = []
    for run, run_plan in plan.items():
        print(f"run {run}: starting (full log: {os.path.join(out_dir, run + '.log')})")
        result = run_trainer(run, run_plan, out_dir, args.steps, args.timeout_s)
        results.append(result)
        print(
            f"run {run}: {'finished' if result.returncode == 0 else 'FAILED'} in {result.wall_s:.0f} s, "
            f"{result.steps} steps, peak memory {result.peak_pss_gib:.1f} GiB"
        )
        if result.returncode != 0:
            print(
                f"odc-grpo-cpu: the {run} run failed (exit code {result.returncode}): "
                f"{last_error(result.log_file)}\n  see {result.log_file}",
                file=sys.stderr,
            )
            return 1
    if len(results) >= 2:
        from ..ab_report import ReportError

        try:
            text = report(results, args, emulation, out_dir)
        except ReportError as e:
            print(f"odc-grpo-cpu: the runs finished, but their A/B report cannot be made: {e}", file=sys.stderr)
            return 1
        with open(os.path.join(out_dir, "report.txt"), "w", encoding="utf-8") as fp:
            fp.write(text + "\n")
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
