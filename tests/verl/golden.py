"""Golden per-step metrics of `odc-grpo-cpu`'s deterministic runs, committed next to this file, so that a
change that moves fsdp2 and odc the same way (a verl patch, the CPU rollout, the assets) is seen too.

    python -m tests.verl.golden [--config NAME] [--out DIR]   # run them and refresh golden/<NAME>.json
    python -m tests.verl.golden --config NAME --check DIR     # compare a finished run's metrics with its file

The configurations (`configs()`): `grpo_cpu`, `odc-grpo-cpu --steps 3` with the KL loss on (the
`grpo_cli` run of test_main_ppo, which checks it against its file), one mini-batch per step and dynamic
batch sizes; `grpo_cpu_example`, the batching of verl's own example scripts
(examples/grpo_trainer/run_qwen2-7b_math.sh: fixed micro-batch sizes, four mini-batches per step, the
low_var_kl KL loss, gradient checkpointing, the reference model's parameters offloaded) with rank 1
slowed down so that LB-Mini's shares are uneven; `grpo_cpu_vl`, the vision-language job of test_vl; and the
other rows of test_verl_settings. Each of those
rows runs odc only and compares it with its file's fsdp2 run, step by step: verl's trainer under fsdp2,
run once when the file was made, here as test_main_ppo's grpo_cli checks for its own configuration that
the file still is what a fresh fsdp2 run computes.
Rewards and lengths are compared exactly (sampling is seeded; they change only when the weights that
sample do), losses and gradient norms to RTOL: float32 sums taken in another order differ by up to 6e-6
here (fsdp2 against odc in one run: the KL loss of step 2; 7e-5 on an earlier asset build), while a
learning rate 1% higher moves the KL loss of steps 2 and 3 by 2% and 6% (and the gradient norm of step 3
by 4%), which RTOL = 1e-3 catches with room on both sides.

A stored run holds only where rounding does not decide a metric: another CPU rounds float32 sums its own way,
and a metric near zero (GMPO's policy loss once its ratios are 1) or one that a ranking picks (KL-Cov's
penalized tokens) moves by far more than RTOL there. So making a file also makes fsdp2's run again under
another of torch's CPU kernel sets (ATEN_CPU_CAPABILITY: avx2 on an AVX-512 CPU, else the scalar one), which
rounds as another CPU would, and stores per step how far each metric moved (`rounding`). A metric that moved
by more than a third of its tolerance is decided by rounding (`rounding_decided`): it is not compared with
the file, and a test that needs it compares odc with fsdp2 run on the same machine in the same test.

Each file also holds a fingerprint of the tiny model the run starts from, the one shipped in the package
(`assets.SHIPPED`, the same on every machine; tests/verl/test_assets.py checks the two agree). A mismatch
is reported first, naming the cache; so are the versions of the libraries that compute the run, when
metrics moved and they differ from those the file was made with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from odc_plugin.verl.ab_report import read_metrics
from odc_plugin.verl.cpu.assets import ensure_assets, model_fingerprint
from odc_plugin.verl.cpu.grpo import RUNS
from odc_plugin.verl.cpu.grpo_config import odc_option

GOLDEN_DIR = Path(__file__).parent / "golden"
KL_LOSS = ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01"]
RUN_ARGS = ["--steps", "3", *KL_LOSS]
# verl's example batching (examples/grpo_trainer/run_qwen2-7b_math.sh) at this machine's size: 8 prompts x 4
# responses per step, mini-batches of 2 prompts (4 per step), 2 samples per update micro-batch, 4 per
# log-prob micro-batch.
FIXED_MICRO_BATCHES = [
    "actor_rollout_ref.actor.use_dynamic_bsz=False",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    # verl requires the log-prob passes to batch as the update does (engine_workers.py:616)
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=False",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
]
EXAMPLE_BATCHING = [
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    *FIXED_MICRO_BATCHES,
    *KL_LOSS,
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
]
# rank 1 five times slower, in both runs: the auto cost's rank speeds then make LB-Mini's shares uneven; LB-Mini
# keeps the equal split unless its plan is predicted faster by more than the fit's recent error, which reached
# 0.2 on a busy 2-core machine; from the rank speeds fitted here (3x: 0.64 / 1.36, 5x: 0.53 / 1.47) the
# best uneven split (2 / 6 samples) is ~30% faster at 3x, ~45% at 5x
EXAMPLE_SLOW_RANKS = "1:5"
# verl's VL GRPO job (tests/verl/test_vl.py): one mini-batch of 4 prompts a step, prompts of 0-3 pictures
VL_BATCH = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", *KL_LOSS]
CONFIGS = {
    "grpo_cpu": RUN_ARGS,
    "grpo_cpu_example": ["--steps", "3", "--slow-ranks", EXAMPLE_SLOW_RANKS, *EXAMPLE_BATCHING],
    "grpo_cpu_vl": ["--model", "qwen2_5_vl", "--steps", "2", "--slow-ranks", EXAMPLE_SLOW_RANKS, *VL_BATCH],
}
EXACT = ("critic/score/mean", "response_length/mean", "prompt_length/mean")
CLOSE = ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/entropy")
# and, in runs with a critic
CRITIC = ("critic/vf_loss", "critic/grad_norm", "critic/values/mean")
RTOL = 1e-3
# The KL loss is a mean of differences of nearly equal log-probs, so the CPU's kernels move it more: built on
# an Intel Xeon, the example batching's step-1 KL loss came out 0.11% lower on an AMD EPYC (every other
# metric within 1e-4); a learning rate 1% higher still moves it by 2-6%.
RTOL_BY_KEY = {"actor/kl_loss": 5e-3}
LIBRARIES = ("torch", "transformers", "tokenizers", "verl")
# A metric that another kernel set moves by more than its tolerance / ROUNDING_MARGIN is decided by rounding:
# an Intel Xeon with AMX moved KL-Cov's step-1 gradient norm 1.5 times as far from this file's AMD EPYC run as
# AVX2 kernels on that EPYC did.
ROUNDING_MARGIN = 3


def golden_metrics(runs: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """The compared metrics of each strategy's steps, as the golden file holds them."""
    return {
        s: {str(step): {k: m[k] for k in EXACT + CLOSE + CRITIC if k in m} for step, m in sorted(runs[s].items())}
        for s in runs
    }


def rtol(key: str) -> float:
    """The relative tolerance of metric `key` against a golden file, which may have been made on another CPU."""
    return max(RTOL, RTOL_BY_KEY.get(key, 0.0))


def stored_run(config: str, strategy: str) -> dict[int, dict]:
    """The golden file's metrics of `strategy`'s run of `config`, by step, as read_metrics gives a run's."""
    return {int(step): metrics for step, metrics in stored(config)["metrics"][strategy].items()}


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def differences(got: dict, want: dict, decided: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """What differs between two golden_metrics, one line each; empty when they agree. The (step, metric)
    pairs of `decided` are left out: rounding decides them (rounding_decided)."""
    lines = []
    for strategy in sorted(set(got) | set(want)):
        steps_got, steps_want = got.get(strategy, {}), want.get(strategy, {})
        if sorted(steps_got) != sorted(steps_want):
            lines.append(f"{strategy}: steps {sorted(steps_got)} instead of {sorted(steps_want)}")
        for step in sorted(set(steps_got) & set(steps_want)):
            a, b = steps_got[step], steps_want[step]
            for key in sorted(set(a) | set(b)):
                if (step, key) in decided:
                    continue
                if key not in a or key not in b:
                    lines.append(
                        f"{strategy} step {step} {key}: {a.get(key, 'missing')} vs golden {b.get(key, 'missing')}"
                    )
                elif key in EXACT and a[key] != b[key] or not math.isclose(a[key], b[key], rel_tol=rtol(key)):
                    lines.append(
                        f"{strategy} step {step} {key}: {a[key]!r} vs golden {b[key]!r} "
                        f"(rel {abs(a[key] - b[key]) / max(abs(b[key]), 1e-30):.2g})"
                    )
    return lines


def library_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in LIBRARIES}


def golden_file(config: str) -> Path:
    return GOLDEN_DIR / f"{config}.json"


def stored(config: str) -> dict:
    return json.loads(golden_file(config).read_text())


def rounding_decided(rounding: dict) -> frozenset[tuple[str, str]]:
    """The (step, metric) pairs that another CPU may make differently beyond their tolerance, as a golden
    file's `rounding` measured them."""
    return frozenset(
        (step, key)
        for step, metrics in rounding["moved"].items()
        for key, difference in metrics.items()
        if difference * ROUNDING_MARGIN > (0.0 if key in EXACT else rtol(key))
    )


def other_kernels() -> str:
    """The kernel set (ATEN_CPU_CAPABILITY) that stands in for another CPU: one this CPU runs, other than the
    one torch picks."""
    import torch

    return "avx2" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "default"


def measure_rounding(args: list[str], runs: dict[str, dict[int, dict]], out_dir: str) -> dict | None:
    """fsdp2's run of `args` made again under other_kernels(): how far each of its metrics moved from `runs`'
    fsdp2, relatively, by step; None if that run failed."""
    import torch

    other = other_kernels()
    # the last --compare is the one odc-grpo-cpu takes
    fsdp2_only = [*(a for a in args if not odc_option(a)), "--compare", "fsdp2"]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": other}
    command = [sys.executable, "-m", "odc_plugin.verl.cpu.grpo", *fsdp2_only, "--out", out_dir]
    if subprocess.run(command, env=env).returncode:
        return None
    here, there = golden_metrics({"here": runs["fsdp2"], "there": read_run(out_dir)["fsdp2"]}).values()
    moved = {
        step: {key: relative_difference(value, there[step][key]) for key, value in metrics.items()}
        for step, metrics in here.items()
    }
    return {"kernels": torch.backends.cpu.get_cpu_capability().lower(), "against": other, "moved": moved}


def compare(
    runs: dict[str, dict[int, dict]], config: str = "grpo_cpu", against: str | None = None, steps: int | None = None
) -> list[str]:
    """What differs between a finished run of `config` and its golden file, one line each; empty when they
    agree. With `against` (a strategy), every run is compared with the golden file's run of that strategy;
    with `steps`, runs of that many steps with the file's first ones."""
    golden = stored(config)
    if against is not None:
        golden["metrics"] = {name: golden["metrics"][against] for name in runs}
    if steps is not None:
        golden["metrics"] = {
            s: {k: m for k, m in by_step.items() if int(k) <= steps} for s, by_step in golden["metrics"].items()
        }
    lines = []
    model_dir = _model_dir(config)
    if golden.get("assets") != (fingerprint := model_fingerprint(model_dir)):
        lines.append(
            f"the run's model ({model_dir}, model {fingerprint}) is not the one the golden metrics start from"
            f" (model {golden.get('assets')}); if the shipped model was refreshed on purpose, refresh the golden files"
        )
    metrics = differences(golden_metrics(runs), golden["metrics"], rounding_decided(golden["rounding"]))
    made_with, have = golden.get("versions", {}), library_versions()
    if metrics and made_with != have:  # a hint where the metrics moved, not a failure of its own
        changed = ", ".join(f"{k} {made_with.get(k)} -> {have[k]}" for k in LIBRARIES if made_with.get(k) != have[k])
        lines.append(f"libraries differ from those the golden metrics were made with: {changed}")
    return lines + metrics


def configs() -> dict[str, list[str]]:
    """Every golden configuration by name, odc-grpo-cpu's arguments: CONFIGS, and the rows of verl's settings
    (tests/verl/test_verl_settings.py), which define theirs."""
    from tests.verl.test_verl_settings import golden_configs

    return {**CONFIGS, **golden_configs()}


def model_of(config: str) -> str:
    """The shipped model `config`'s runs start from: its `--model`, else the Qwen2."""
    args = configs()[config]
    return args[args.index("--model") + 1] if "--model" in args else "qwen2"


def _model_dir(config: str) -> str:
    return ensure_assets(log=lambda _: None, model=model_of(config)).model_dir


def read_run(out_dir: str) -> dict[str, dict[int, dict]]:
    return {
        s: read_metrics(os.path.join(out_dir, f"{s}.jsonl"))
        for s in RUNS
        if os.path.exists(os.path.join(out_dir, f"{s}.jsonl"))
    }


def refresh(config: str, out_dir: str) -> int:
    """Run `config` and rewrite its golden file; prints what changed."""
    path = golden_file(config)
    old = json.loads(path.read_text())["metrics"] if path.exists() else {}
    args = configs()[config]
    proc = subprocess.run([sys.executable, "-m", "odc_plugin.verl.cpu.grpo", *args, "--out", out_dir])
    if proc.returncode:
        print(f"the run failed (exit {proc.returncode}); {path} left as it was")
        return proc.returncode
    runs = read_run(out_dir)
    new = golden_metrics(runs)
    lines = differences(new, old)
    if (rounding := measure_rounding(args, runs, os.path.join(out_dir, "other_kernels"))) is None:
        print(f"fsdp2's run under ATEN_CPU_CAPABILITY={other_kernels()} failed; {path} left as it was")
        return 1
    decided = sorted(rounding_decided(rounding))
    print(f"decided by rounding (not compared with the file): {decided or 'nothing'}")
    if rollouts := [(step, key) for step, key in decided if key in EXACT]:
        print(f"another CPU samples other responses ({rollouts}); {path} left as it was: choose other settings")
        return 1
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "command": f"odc-grpo-cpu {' '.join(args)}",
                "assets": model_fingerprint(_model_dir(config)),
                "versions": library_versions(),
                "rtol": RTOL,
                "rounding": rounding,
                "metrics": new,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{path} refreshed; what changed:" if lines else f"{path} refreshed; nothing changed")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.verl.golden", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=configs(), help="which configuration (default: every one)")
    parser.add_argument("--out", default="golden_run", help="where the refreshing runs write (default ./golden_run)")
    parser.add_argument("--check", metavar="DIR", help="compare the run of --config in DIR with its golden file")
    args = parser.parse_args(argv)
    if args.check:
        if args.config is None:
            parser.error("--check needs --config")
        lines = compare(read_run(args.check), args.config)
        print("\n".join(lines) if lines else f"{args.check} matches {golden_file(args.config)}")
        return 1 if lines else 0
    for config in [args.config] if args.config else list(configs()):
        if rc := refresh(config, os.path.join(args.out, config)):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
