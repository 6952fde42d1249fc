"""`odc-sft-cpu`: verl's real SFT trainer (`torchrun -m verl.trainer.sft_trainer`, or with `--ray`
`python -m verl.trainer.sft_trainer_ray`) on this machine's CPU, once with `engine.strategy=fsdp2` and once
with `engine.strategy=odc`, same data, weights and settings, then the A/B report of the two runs (with
`--emulate`, also FSDP's lockstep on ODC's transport between them; with `--split`, then odc with
`engine.odc_split=auto`).

    odc-sft-cpu [--ranks N] [--steps N] [--out DIR] [--slow-ranks R:F] [--ray] [--split] [key=value ...]
    odc-sft-cpu --emulate FIT.json [--ranks 16] [--length-factor K] [--time-scale X] ...

The data set is written from the shipped tiny model's assets: multi-turn chats of the math problems, their
lengths long-tailed (most short, a few many times longer). With `--emulate` every decoder layer's compute
takes the GPU fit's time for its micro-batch's true lengths (each real token stands for `--length-factor`
true ones), the lengths are drawn from odc-plan's long-context SFT profile (`--lengths sft`), and the report
adds the planner's prediction for the plans each run ran. Each `key=value` goes to both runs as a hydra
override; `engine.odc_*` options go to the odc run only. Each run's output goes to DIR/<strategy>.log, its
metrics (verl's `file` logger) to DIR/<strategy>.jsonl, the report to DIR/report.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import shutil
import socket
import sys
import threading
import time

from ...cli_args import number_arg
from ...launch import stop_group
from ...layer_time import parse_slow_ranks, time_scale_arg
from ..sft import RAY_MODULE, SPMD_MODULE
from . import EMULATION_ENV, PLATFORM_ENV, SLOW_RANKS_ENV
from .assets import ensure_assets
from .emulation import Emulation, read_passes
from .runner import end_ray, follow, last_error, ray_session, run_files, start_logged
from .text_assets import make_problems, prompt_messages

ODC_OPTION = "engine.odc_"
ODC_SEARCH_PATH = ("hydra.searchpath=[pkg://odc_plugin.configs]", "engine=odc")
# The runs: fsdp2 and odc, and with --emulate between them FSDP's per-layer lockstep on ODC's transport and
# code, which separates what the transport changes (on CPU: shared-memory copies against gloo) from the idea.
RUNS = {
    "fsdp2": ["engine.strategy=fsdp2"],
    "lockstep": [*ODC_SEARCH_PATH, "engine.odc_balancer=lb_micro", "engine.odc_lockstep=True"],
    "odc": ["engine.strategy=odc"],
    "split": [*ODC_SEARCH_PATH, "engine.odc_split=auto"],
}
# what a real run's chats look like: mostly one or two problems, a few many (real tokens)
SHORT_TURNS, LONG_TURNS, LONG_FRACTION = (1, 2), (4, 8), 0.2
# tokens of one problem's turn (question and worked answer) in the shipped tokenizer's chat template: mean, most
TURN_TOKENS, MAX_TURN_TOKENS = 84, 119
# the longest chat, in turns, and the token budget that holds it
MAX_TURNS = 24
MAX_REAL_TOKENS = MAX_TURNS * MAX_TURN_TOKENS
# samples per rank per step: a few on real compute; with --emulate odc-demo's default mini-batch (its sft case)
SAMPLES_PER_RANK, EMULATED_SAMPLES_PER_RANK = 4, 8


def sample_turns(num: int, seed: int, emulation: Emulation | None) -> list[int]:
    """Problem turns per chat: a long-tailed mixture, or with an emulation the real tokens of lengths drawn
    from odc-plan's long-context SFT profile, in turns."""
    if emulation is None:
        rng = random.Random(seed)
        return [rng.randint(*(LONG_TURNS if rng.random() < LONG_FRACTION else SHORT_TURNS)) for _ in range(num)]
    from ...balance.lengths import sft_long_context_like

    sample = sft_long_context_like(num, max_length=MAX_TURNS * TURN_TOKENS * emulation.length_factor, seed=seed)
    true = [p + r for p, r in zip(sample.prompt_lens, sample.response_lens)]
    return [min(MAX_TURNS, max(1, round(t / emulation.length_factor / TURN_TOKENS))) for t in true]


def write_data(out_dir: str, num_train: int, num_val: int, seed: int, emulation: Emulation | None) -> tuple[str, str]:
    """The train and validation parquet files: chats of the shipped math problems, `messages` as verl's
    multi-turn SFT data set reads them."""
    import pandas as pd

    turns = sample_turns(num_train + num_val, seed, emulation)
    problems = make_problems(sum(turns), seed)
    rows, start = [], 0
    for count in turns:
        messages = []
        for p in problems[start : start + count]:
            messages += [*prompt_messages(p), {"role": "assistant", "content": p.solution}]
        rows.append({"messages": messages})
        start += count
    files = os.path.join(out_dir, "sft_train.parquet"), os.path.join(out_dir, "sft_val.parquet")
    pd.DataFrame(rows[:num_train]).to_parquet(files[0])
    pd.DataFrame(rows[num_train:]).to_parquet(files[1])
    return files


def settings(
    model_dir: str, files: tuple[str, str], ranks: int, steps: int, samples_per_rank: int, emulated: bool
) -> list[str]:
    """What both runs share: verl's SFT trainer on `ranks` CPU ranks, fp32, dynamic batch size, validation at
    the last step (none in an emulated run, whose passes are all training passes)."""
    budget = MAX_REAL_TOKENS
    return [
        f"data.train_files={files[0]}",
        f"data.val_files={'null' if emulated else files[1]}",
        "data.messages_key=messages",
        f"data.train_batch_size={ranks * samples_per_rank}",
        "data.use_dynamic_bsz=True",
        f"data.max_token_len_per_gpu={budget}",
        f"data.max_length={budget}",
        "data.num_workers=0",
        f"model.path={model_dir}",
        "+model.override_config.attn_implementation=sdpa",
        "model.use_remove_padding=True",
        # an emulated layer takes the fit's forward-and-backward time once: no recomputed forwards
        f"model.enable_gradient_checkpointing={not emulated}",
        "engine.use_torch_compile=False",
        "engine.full_determinism=True",
        "+engine.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "optim.lr=1e-4",
        "trainer.device=cpu",
        "trainer.logger=[console,file]",
        "trainer.project_name=odc_sft_cpu",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={-1 if emulated else steps}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
    ]


def run_args(shared: list[str], strategy: str, overrides: list[str], out_dir: str) -> list[str]:
    odc = [o for o in overrides if o.lstrip("+").startswith(ODC_OPTION)]
    engine = RUNS[strategy]
    if strategy in ("odc", "split") and odc:
        engine = [*ODC_SEARCH_PATH, *(o for o in engine if o.startswith(ODC_OPTION)), *odc]
    return [
        *shared,
        *engine,
        f"trainer.experiment_name={strategy}",
        f"trainer.default_local_dir={os.path.join(out_dir, 'checkpoints', strategy)}",
        f"hydra.run.dir={os.path.join(out_dir, 'hydra-' + strategy)}",
        *(o for o in overrides if o not in odc),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_command(ranks: int, args: list[str], ray: bool, ray_dir: str | None) -> tuple[list[str], dict]:
    """The command line and environment of one run: torchrun's trainer, or Ray's trainer on a Ray cluster of
    its own (its session in `ray_dir`; as many Ray GPUs as ranks, which the CPU platform stands for)."""
    if not ray:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            f"--master-port={_free_port()}",
        ]
        return [*cmd, "-m", SPMD_MODULE, *args], {}
    # verl's Ray SFT trainer calls ray.init() with no arguments: Ray takes its resources from the environment.
    # Its resource pool, built as the trainer builds it, asks a bundle of `max_colocate_count` CPUs per rank: too
    # few, and the placement group waits forever.
    from verl.single_controller.ray.base import RayResourcePool

    per_rank = RayResourcePool(process_on_nodes=[ranks]).max_colocate_count
    resources = json.dumps({"GPU": ranks, "CPU": per_rank * ranks + 8})
    env = {"RAY_TMPDIR": ray_dir, "RAY_OVERRIDE_RESOURCES": resources}
    return [sys.executable, "-m", RAY_MODULE, *args, f"trainer.n_gpus_per_node={ranks}"], env


def run_trainer(strategy: str, ranks: int, args: list[str], out_dir: str, env: dict, timeout_s: float, ray=False):
    """One run of verl's SFT trainer (torchrun's, or with `ray` Ray's); (exit code, wall seconds, log file). The
    whole process group, and Ray's processes, go when the time is up. verl's SFT trainer logs no time: each
    step's, from the moment its console line came after the last step's, is added to the run's metrics file
    as `timing_s/step` (none for the first)."""
    log_file, metrics_file = run_files(out_dir, strategy)
    env = {**os.environ, **env, PLATFORM_ENV: "cpu", "VERL_FILE_LOGGER_PATH": metrics_file, "PYTHONUNBUFFERED": "1"}
    ray_dir = ray_session(env) if ray else None
    cmd, own_env = trainer_command(ranks, args, ray, ray_dir)
    env.update(own_env)
    start, seen = time.monotonic(), {}
    with open(log_file, "w", encoding="utf-8") as log:
        proc = start_logged(cmd, env, log)
        expired = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (expired.set(), stop_group(proc)))
        timer.start()
        try:
            follow(proc, log, lambda step, _: seen.setdefault(step, time.monotonic()))
            code = proc.wait()
        except BaseException:
            stop_group(proc)
            raise
        finally:
            timer.cancel()
            if ray_dir:
                end_ray(ray_dir)
        if expired.is_set():  # the line last_error reports
            log.write(f"TimeoutError: the run took longer than --timeout-s {timeout_s:g} s and was stopped\n")
    if code == 0:
        add_metrics(metrics_file, {k: {"timing_s/step": seen[k] - seen[k - 1]} for k in seen if k - 1 in seen})
    return code, time.monotonic() - start, log_file


def add_metrics(metrics_file: str, by_step: dict[int, dict[str, float]]) -> None:
    """Each step's `by_step` metrics into the run's first record of that step."""
    with open(metrics_file, encoding="utf-8") as fp:
        records = [json.loads(line) for line in fp if line.strip()]
    for record in records:
        record["data"].update(by_step.pop(record["step"], {}))
    with open(metrics_file, "w", encoding="utf-8") as fp:
        fp.writelines(json.dumps(r) + "\n" for r in records)


def update_times(passes_dir: str) -> dict[int, dict[str, float]]:
    """An emulated run's update time per step: its slowest rank's training pass (each rank records one a step)."""
    per_rank = read_passes(passes_dir, "seconds").get("update_actor", {})
    steps = zip(*per_rank.values())
    return {k: {"timing_s/update_actor": max(seconds)} for k, seconds in enumerate(steps, start=1)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="odc-sft-cpu", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--ranks", type=number_arg(int, 1), default=2, help="training ranks (default 2)")
    p.add_argument("--steps", type=number_arg(int, 1), default=4, help="optimizer steps per run (default 4)")
    p.add_argument("--out", default="odc_sft_cpu", help="output directory (default ./odc_sft_cpu)")
    p.add_argument("--slow-ranks", metavar="R:F[,R:F]", help="rank R's layers take F times as long")
    p.add_argument(
        "--samples-per-rank", type=number_arg(int, 1, strict=False), help="per step (default 4; 8 with --emulate)"
    )
    p.add_argument("--ray", action="store_true", help="verl's Ray SFT trainer instead of torchrun's")
    p.add_argument("--split", action="store_true", help="also odc with engine.odc_split=auto (torchrun's trainer)")
    p.add_argument("--emulate", metavar="FIT.json", help="emulate the layers' compute from this GPU cost fit")
    p.add_argument("--length-factor", type=number_arg(int, 1), default=16, help="true tokens per real token")
    p.add_argument("--time-scale", type=time_scale_arg, default=1.0, help="emulated seconds per fit second")
    p.add_argument("--seed", type=number_arg(int, 0), default=0)
    p.add_argument("--timeout-s", type=number_arg(float, 1), default=1800.0, help="per run")
    p.add_argument("overrides", nargs="*", help="hydra overrides for both runs (engine.odc_* for the odc run)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides are key=value, got {bad[0]!r}")
    try:
        parse_slow_ranks(args.slow_ranks, args.ranks)
        emulation = Emulation(args.emulate, args.time_scale, args.length_factor) if args.emulate else None
        if emulation:
            emulation.check()
    except ValueError as e:
        parser.error(str(e))
    out_dir = os.path.abspath(args.out)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        parser.error(f"--out {args.out} is a file: name a directory (created if missing)")
    os.makedirs(out_dir, exist_ok=True)
    samples = args.samples_per_rank or (EMULATED_SAMPLES_PER_RANK if emulation else SAMPLES_PER_RANK)
    files = write_data(out_dir, args.ranks * samples * args.steps, args.ranks * samples, args.seed, emulation)
    shared = settings(ensure_assets().model_dir, files, args.ranks, args.steps, samples, emulation is not None)
    print(f"verl SFT on CPU, {args.ranks} ranks, {args.steps} steps per run; output in {out_dir}")
    results = {}
    for strategy in [r for r in RUNS if (emulation or r != "lockstep") and (args.split or r != "split")]:
        env = {SLOW_RANKS_ENV: args.slow_ranks} if args.slow_ranks else {}
        if emulation:
            passes = os.path.join(out_dir, f"{strategy}-passes")
            shutil.rmtree(passes, ignore_errors=True)  # an earlier run's passes would count as this one's
            os.makedirs(passes)
            own = dataclasses.replace(emulation, passes_dir=passes)
            own.save(os.path.join(out_dir, f"{strategy}.emulation.json"))
            env[EMULATION_ENV] = os.path.join(out_dir, f"{strategy}.emulation.json")
        run = run_args(shared, strategy, args.overrides, out_dir)
        launcher = ["python", "-m", RAY_MODULE] if args.ray else ["torchrun", "-m", SPMD_MODULE]
        print(f"run {strategy}: {shlex.join([*launcher, *run])}")
        code, wall, log_file = run_trainer(strategy, args.ranks, run, out_dir, env, args.timeout_s, args.ray)
        if code == 0 and emulation:
            add_metrics(os.path.join(out_dir, f"{strategy}.jsonl"), update_times(own.passes_dir))
        print(f"run {strategy}: {'finished' if code == 0 else 'FAILED'} in {wall:.0f} s")
        if code != 0:
            print(f"odc-sft-cpu: the {strategy} run failed (exit code {code}): {last_error(log_file)}", file=sys.stderr)
            return 1
        results[strategy] = os.path.join(out_dir, f"{strategy}.jsonl")
    text = report(results, args, emulation, out_dir)
    with open(os.path.join(out_dir, "report.txt"), "w", encoding="utf-8") as fp:
        fp.write(text + "\n")
    print("\n" + text)
    return 0


def _what_decides(odc: dict, ranks: int) -> str:
    """What a run on this machine's own compute measures, from the odc run's medians."""
    step, compute, wait = odc["step_s"], odc["actor_odc_compute_s_mean"], odc["actor_odc_wait_s_mean"]
    if None in (step, compute, wait):
        return ""
    return (
        f"at this size: a step of {step:.3g} s, of which the {ranks} ranks compute {compute:.3g} s and wait "
        f"{wait:.3g} s for each other (odc's medians): LB-Mini can win no more than that wait, so the steps' own "
        "difference decides the ratio; --slow-ranks makes the work uneven, --emulate rehearses a GPU job's scale"
    )


def report(results: dict[str, str], args, emulation: Emulation | None, out_dir: str) -> str:
    from .. import ab_report
    from .emulation import phase_times

    runs = [ab_report.load_run(path, name, skip_first=1 if args.steps > 2 else 0) for name, path in results.items()]
    text = ab_report.format_report(ab_report.compare(runs[0], runs[-1]))
    if emulation is None:
        return text + "\n" + _what_decides(ab_report.summarize(runs[-1]), args.ranks)
    slowdowns = parse_slow_ranks(args.slow_ranks, args.ranks)
    slowdowns = [slowdowns.get(r, 1.0) for r in range(args.ranks)]
    # the passes record a split micro-batch's whole lengths on every member: the split run's plans are timed by
    # the trainer's own planner instead (its odc_balance metrics, in the auto fit's seconds)
    times = {
        name: phase_times(emulation, os.path.join(out_dir, f"{name}-passes"), args.steps, slowdowns, name != "odc")
        for name in results
        if name != "split"
    }
    label = f"EMULATED: {args.ranks} ranks, fit {os.path.basename(args.emulate)}, length factor {args.length_factor}"
    text += "\n\n" + ab_report.phase_report(runs, times, {}, label)
    if "split" in results:
        text += "\n" + ab_report.split_prediction(runs[-1])
    return text


if __name__ == "__main__":
    sys.exit(main())
