"""`odc-grpo-cpu`: verl's real GRPO trainer (`python -m verl.trainer.main_ppo`) on this machine's CPU,
once with `strategy=fsdp2` and once with `strategy=odc` (or the runs `--compare` names), same seed,
data and settings, then the A/B report of the runs.

    odc-grpo-cpu [--steps N] [--out DIR] [--model qwen2|qwen3_moe] [--slow-ranks R:F] [key=value ...]
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
import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ...cli_args import number_arg
from ...layer_time import AUTO_SHARE_S, auto_time_scale, parse_slow_ranks, time_scale_arg
from . import EMULATION_ENV, PLATFORM_ENV, SLOW_RANKS_ENV
from .assets import MODELS, Assets, ensure_assets
from .emulation import RL_LENGTHS, Emulation

STRATEGIES = ("fsdp2", "odc")
# The keys that set the strategy: one value for every trained role.
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "critic.strategy")
# Where each role's engine options go (actor, reference model, critic).
ENGINE_CONFIGS = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")
# The odc engine's options on the hydra search path, so that they can be set (README, Options).
ODC_OPTIONS = ("hydra.searchpath=[pkg://odc_plugin.configs]", "model_engine=odc")


def _every_engine(*options: str) -> list[str]:
    return [f"{prefix}.{option}" for option in options for prefix in ENGINE_CONFIGS]


def odc_option(override: str) -> bool:
    """An override of an odc engine option (README, Options): only runs of strategy odc have these keys."""
    prefix, _, name = override.split("=", 1)[0].lstrip("+").rpartition(".")
    return prefix in ENGINE_CONFIGS and name.startswith("odc_")


# The runs a comparison may make: each one's strategy and its own engine options. fsdp2 and odc are what
# users run; lockstep is FSDP's per-layer synchronization on ODC's transport and code (the same-transport
# baseline), odc_lb_micro is ODC on verl's equal split; so run to run each factor of odc-demo's rows.
RUNS = {
    "fsdp2": ("fsdp2", []),
    "lockstep": ("odc", [*ODC_OPTIONS, *_every_engine("odc_balancer=lb_micro", "odc_lockstep=True")]),
    "odc_lb_micro": ("odc", [*ODC_OPTIONS, *_every_engine("odc_balancer=lb_micro")]),
    "odc": ("odc", []),
}
_ENV = "ray_kwargs.ray_init.runtime_env.env_vars"
# Keys odc-grpo-cpu sets itself, per run or because it needs them, and what to use instead of overriding them.
HARNESS_KEYS = {
    **{key: "use --compare (each run's strategy is its own)" for key in STRATEGY_KEYS},
    "model_engine": "use --compare, and give odc engine options as plain keys (the odc runs get the plugin's configs)",
    "hydra.searchpath": "give odc engine options as plain keys (the odc runs get the plugin's configs)",
    "trainer.experiment_name": "use --compare (each run is named after itself)",
    "trainer.total_training_steps": "use --steps",
    "trainer.total_epochs": "use --steps",
    "trainer.logger": "leave it out: the report reads each run's metrics from verl's file logger",
    "trainer.n_gpus_per_node": "use --ranks",
    "trainer.nnodes": "leave it out: the runs train on this one machine",
    "trainer.device": "leave it out: the runs train on CPU",
    "trainer.default_local_dir": "use --out",
    "hydra.run.dir": "use --out",
    "ray_kwargs.ray_init._temp_dir": "leave it out: each run's Ray session lives in its own temporary directory",
    f"{_ENV}.VERL_FILE_LOGGER_PATH": "use --out",
    f"{_ENV}.{PLATFORM_ENV}": "leave it out: the runs train on CPU",
    f"{_ENV}.{SLOW_RANKS_ENV}": "use --slow-ranks",
    f"{_ENV}.{EMULATION_ENV}": "use --emulate",
    **{key: "use --compare (lockstep, odc_lb_micro)" for key in _every_engine("odc_balancer", "odc_lockstep")},
}


def harness_key_error(overrides: list[str]) -> str | None:
    """The error for the first override of a key that odc-grpo-cpu sets itself; None if there is none."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in HARNESS_KEYS:
            return f"odc-grpo-cpu sets {key} itself: {HARNESS_KEYS[key]}"
    return None


STEP_LINE = re.compile(r"\bstep:(\d+) - ")
# GRPO responses per prompt. Prompt tokens allowed: the data's longest prompt has 69; an emulated run's
# micro-batch budget just holds the longest sample, as odc-demo's rl case does.
GROUP_SIZE, MAX_PROMPT_TOKENS, LONGEST_PROMPT = 4, 96, 72
# The "auto" time scale's share grows with the ranks beyond this many: what the rehearsal itself costs
# (verl's and the engines' per-pass collectives, Python between layers, on 2 cores) grows with them.
AUTO_RANKS = 8


def settings(assets: Assets, ranks: int, steps: int, out_dir: str, emulation: Emulation | None = None) -> list[str]:
    """Everything all runs share: a small GRPO job on `ranks` CPU training ranks; with drawn response lengths
    (an emulated run) odc-demo's rl case: one prompt of GROUP_SIZE responses per rank, all in one
    mini-batch, micro-batches that just hold the longest sample, the KL loss on (so the reference model
    runs: a phase of its own) and no activation checkpointing (the fit times forward and backward).

    Long because it is one list of hydra overrides, read top to bottom.
    """
    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    longest_response = emulation and emulation.max_response_tokens()
    if longest_response:
        prompts, prompt_tokens, response_tokens = ranks, LONGEST_PROMPT, longest_response
        train_budget = infer_budget = LONGEST_PROMPT + longest_response
        rl_case = [
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "critic.model.enable_gradient_checkpointing=False",
            f"critic.ppo_max_token_len_per_gpu={train_budget}",
        ]
    else:
        prompts, prompt_tokens, response_tokens, train_budget, infer_budget, rl_case = (
            8,
            MAX_PROMPT_TOKENS,
            64,
            160,
            1024,
            [],
        )
    engine = []
    for prefix in ENGINE_CONFIGS:
        # fp32; seeded model set-up (the critic's value head is initialised at random)
        engine += [
            f"+{prefix}.mixed_precision={fp32}",
            f"{prefix}.use_torch_compile=False",
            f"{prefix}.full_determinism=True",
        ]
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={prompt_tokens}",
        f"data.max_response_length={response_tokens}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.seed=1",
        # verl starts 8 data-loader, agent-loop, reward and TransferQueue storage processes each by default;
        # every one imports torch and verl, which on two cores costs minutes and gigabytes for nothing.
        "data.dataloader_num_workers=0",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        # used when a run trains a critic (algorithm.adv_estimator=gae)
        f"critic.model.path={assets.model_dir}",
        "+critic.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        # a sample or two per micro-batch, several micro-batches per rank: each rank packs its own (odc),
        # or every rank runs as many as the busiest (verl's same_micro_num_in_dp, fsdp2)
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={train_budget}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.n={GROUP_SIZE}",
        "actor_rollout_ref.rollout.dtype=float32",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={ranks}",
        "actor_rollout_ref.rollout.full_determinism=True",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={infer_budget}",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={infer_budget}",
        *engine,
        *rl_case,
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.nnodes=1",
        "trainer.logger=[console,file]",
        "trainer.project_name=odc_grpo_cpu",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={os.path.join(out_dir, 'checkpoints')}",
        # verl counts accelerators in Ray's "GPU" resource; each training rank claims one (no CUDA is used).
        f"+ray_kwargs.ray_init.num_gpus={ranks}",
        # verl's placement groups ask for 3 CPUs per rank (its max_colocate_count), its other actors one each;
        # a laptop has fewer than they add up to, and none of them needs a core of its own.
        f"ray_kwargs.ray_init.num_cpus={32 + 3 * ranks}",
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]


def strategy_args(run: str, overrides: list[str] = ()) -> list[str]:
    """What sets a run apart from the others: its strategy and its own engine options, and for a run of
    strategy odc the user's odc engine options among `overrides` (the plugin's configs put on the search
    path for them); the other runs' engine configs have no such keys."""
    strategy, options = RUNS[run]
    odc = [o for o in overrides if odc_option(o)] if strategy == "odc" else []
    path = [o for o in ODC_OPTIONS if o not in options and o not in overrides] if odc else []
    return [*(f"{key}={strategy}" for key in STRATEGY_KEYS), *options, *path, *odc]


def run_args(
    shared: list[str],
    run: str,
    overrides: list[str],
    metrics_file: str,
    slow_ranks: str | None = None,
    emulation_file: str | None = None,
) -> list[str]:
    # hydra's own files (config dump, job log) next to the run's, not in the caller's directory
    hydra_dir = os.path.join(os.path.dirname(metrics_file), f"hydra-{run}")
    env = f"+{_ENV}"
    slow = [f"{env}.{SLOW_RANKS_ENV}='{slow_ranks}'"] if slow_ranks else []
    emulated = [f"{env}.{EMULATION_ENV}={emulation_file}"] if emulation_file else []
    return [
        *shared,
        *strategy_args(run, overrides),
        f"trainer.experiment_name={run}",
        f"hydra.run.dir={hydra_dir}",
        f"{env}.VERL_FILE_LOGGER_PATH={metrics_file}",
        f"{env}.{PLATFORM_ENV}=cpu",
        *slow,
        *emulated,
        *(o for o in overrides if not odc_option(o)),
    ]


class ConfigRejected(ValueError):
    """verl refused the composed configuration of a run."""


def validate(args: list[str], strategy: str) -> None:
    """Compose the run's configuration as `main_ppo` does and run verl's own checks (no Ray, no training)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .. import ppo_config

    try:
        ppo_config.check(ppo_config.compose(args))
    except (HydraException, OmegaConfBaseException, AssertionError, ValueError, TypeError) as e:
        cause = e
        while isinstance(cause, HydraException) and cause.__cause__ is not None:  # hydra wraps a target's error
            cause = cause.__cause__
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigRejected(f"verl rejects the {strategy} run's configuration: {message}") from e


@dataclass
class RunResult:
    strategy: str
    returncode: int
    wall_s: float
    peak_pss_gib: float  # proportional set size of the trainer's process tree (driver, Ray, workers, rollout)
    steps: int  # training steps the run logged
    log_file: str
    metrics_file: str
    ray_dir: str  # the Ray session's directory (removed afterwards); no process may still name it


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def ray_processes(ray_dir: str) -> list:
    """Processes of the Ray cluster started with `_temp_dir=ray_dir` (gcs, raylet, workers, ...)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(ray_dir in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _kill(procs) -> None:
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as fp:  # the kernel's sum, cheaper than psutil's full smaps
        for line in fp:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class _Watch(threading.Thread):
    """Samples the run's memory, and kills the run at its deadline."""

    def __init__(self, proc: subprocess.Popen, ray_dir: str, timeout_s: float):
        super().__init__(daemon=True)
        self.proc, self.ray_dir, self.deadline = proc, ray_dir, time.monotonic() + timeout_s
        self.peak_pss, self.timed_out, self.seen = 0, False, {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        # Reading a process's PSS walks its page tables (~6 ms for a torch process, ~30 processes per run):
        # every 2 s keeps the sampling's own CPU time to a few percent of one core.
        while not self._stop_event.wait(2.0):
            total = 0
            for proc in _tree(self.proc.pid):
                self.seen[proc.pid] = proc
                with contextlib.suppress(OSError, psutil.Error):
                    total += _pss(proc.pid)  # shared pages (torch, verl) counted once
            self.peak_pss = max(self.peak_pss, total)
            if time.monotonic() > self.deadline and self.proc.poll() is None:
                self.timed_out = True
                _kill(_tree(self.proc.pid))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        # Ray daemons outlive a killed driver; nothing of this run may stay behind.
        _kill([p for p in self.seen.values() if p.is_running()] + ray_processes(self.ray_dir))


# verl picks its rendezvous port by binding port 0 and releasing it (`get_master_addr_port`); rank 0
# listens on it seconds later, and any process on the machine may take it in between (an outgoing
# connection, another job's gloo). Stock verl fails such a run at start; nothing has trained then.
_PORT_TAKEN = "EADDRINUSE"
PORT_RETRIES = 2


def run_trainer(strategy: str, args: list[str], out_dir: str, steps: int, timeout_s: float, echo=print) -> RunResult:
    """One `python -m verl.trainer.main_ppo` run; its output goes to DIR/<strategy>.log, progress to `echo`.
    A run whose rendezvous port was taken before its first step is started again, up to PORT_RETRIES
    times; the failed attempt's log is kept as DIR/<strategy>.port-taken-<n>.log."""
    attempt = 0
    while True:
        result = _run_once(strategy, args, out_dir, steps, timeout_s, echo)
        if attempt == PORT_RETRIES or not port_taken_at_start(result):
            return result
        attempt += 1
        os.replace(result.log_file, os.path.join(out_dir, f"{strategy}.port-taken-{attempt}.log"))
        echo(f"  {strategy}: verl's rendezvous port was taken before rank 0 listened; starting the run again")


def port_taken_at_start(result: RunResult) -> bool:
    """Whether a run failed before its first step because its rendezvous port was taken."""
    if result.returncode == 0 or result.steps:
        return False
    with open(result.log_file, encoding="utf-8", errors="replace") as fp:
        return _PORT_TAKEN in fp.read()


def _run_once(strategy: str, args: list[str], out_dir: str, steps: int, timeout_s: float, echo) -> RunResult:
    log_file = os.path.join(out_dir, f"{strategy}.log")
    metrics_file = os.path.join(out_dir, f"{strategy}.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)  # verl's file logger appends
    # Ray's socket paths must stay short (AF_UNIX), so its session lives under /tmp, not under `out_dir`.
    ray_dir = tempfile.mkdtemp(prefix="odc-ray-")
    env = {**os.environ, PLATFORM_ENV: "cpu", "VERL_FILE_LOGGER_PATH": metrics_file, "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # an empty value makes Ray hide its fake GPUs
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args, f"+ray_kwargs.ray_init._temp_dir={ray_dir}"]
    start = time.monotonic()
    done = 0
    with open(log_file, "w", encoding="utf-8") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        watch = _Watch(proc, ray_dir, timeout_s)
        watch.start()
        try:
            for line in proc.stdout:
                log.write(line)
                match = STEP_LINE.search(line)
                if match:
                    done = int(match.group(1))
                    seconds = re.search(r"timing_s/step:([0-9.]+)", line)
                    took = f" ({float(seconds.group(1)):.1f} s)" if seconds else ""
                    echo(f"  {strategy}: step {done}/{steps} done{took}")
            proc.wait()
        except BaseException:
            _kill(_tree(proc.pid))
            raise
        finally:
            watch.stop()
            shutil.rmtree(ray_dir, ignore_errors=True)
    wall = time.monotonic() - start
    returncode = proc.returncode if not watch.timed_out else -signal.SIGKILL
    if watch.timed_out:
        with open(log_file, "a", encoding="utf-8") as log:
            log.write(f"\nodc-grpo-cpu: killed after {timeout_s:g} s\n")
    return RunResult(strategy, returncode, wall, watch.peak_pss / 2**30, done, log_file, metrics_file, ray_dir)


# A line that states an exception: its class name (dotted or not) first, then ":" or "(" or nothing
# ("ValueError: ...", "ray.exceptions.ActorDiedError: ...", "ValueError(...)"); not a warning that
# mentions one ("UserWarning: ... ModuleNotFoundError(...)").
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?:\(.*\))?(?:[:(].*)?$"
)
# torchrun's own exception after a rank failed: the rank's is the one to report
_LAUNCHER_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
# Ray prefixes a worker's output with its name and pid: "(TaskRunner pid=123) ", "(WorkerDict pid=4, ip=...) ".
_RAY_PREFIX = re.compile(r"^\([^()]*pid=\d+[^()]*\)\s*")


def last_error(log_file: str) -> str:
    """The exception that ended a failed run, as its own line states it: the last line of the run's
    output that starts with an exception's name (warnings printed after it are passed over), with the
    note ODC puts under a rank's own exception that failed a mini-batch on every rank (which rank); else
    the last line naming an error; else the last line."""
    with open(log_file, encoding="utf-8", errors="replace") as fp:
        lines = [_RAY_PREFIX.sub("", line.strip()) for line in fp if line.strip()]
    for i in reversed(range(len(lines))):
        if _EXCEPTION_LINE.match(lines[i]) and not lines[i].startswith(_LAUNCHER_ERROR):
            note = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("ODC: ") else ""
            return f"{lines[i]} ({note})" if note else lines[i]
    errors = [line for line in lines if re.search(r"(Error|Exception|error:)", line) and "Warning" not in line]
    return (errors or lines or ["(no output)"])[-1]


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
        "transport: the same-transport baseline), odc_lb_micro (ODC on verl's equal split) and odc "
        "(ODC with LB-Mini); default fsdp2,odc",
    )
    parser.add_argument(
        "--timeout-s", type=number_arg(), default=1800.0, help="a run still going after this is killed (default 1800)"
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="qwen2",
        help="the tiny model trained (and the critic's, with a critic): a Qwen2 or a Qwen3-MoE",
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
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="hydra overrides for every run")
    return parser


def emulation_of(args, ranks: int) -> Emulation | None:
    """The runs' Emulation from the command line (checked: a bad fit or profile raises a one-line
    ValueError), its time scale resolved; None when nothing is emulated or drawn."""
    if args.emulate is None:
        for flag, value in (("--time-scale", args.time_scale), ("--length-factor", args.length_factor)):
            if value is not None and (flag == "--time-scale" or args.response_lengths is None):
                raise ValueError(
                    f"{flag} needs --emulate" + ("" if flag == "--time-scale" else " or --response-lengths")
                )
    if args.emulate is None and args.response_lengths is None:
        return None
    fit = os.path.abspath(args.emulate) if args.emulate else None
    emulation = Emulation(
        fit,
        length_factor=64 if args.length_factor is None else args.length_factor,
        response_lengths=args.response_lengths or RL_LENGTHS,
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
    from .emulation import phase_times

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
        for r in results:
            own = Emulation(
                **{**dataclasses.asdict(emulation), "passes_dir": os.path.join(out_dir, f"{r.strategy}-passes")}
            )
            times[r.strategy] = phase_times(
                own, own.passes_dir, r.steps, slowdowns, lockstep=r.strategy in ("fsdp2", "lockstep")
            )
        label = describe(emulation).splitlines()[0]
    memory = {r.strategy: r.peak_pss_gib for r in results}
    return text + "\n\n" + ab_report.phase_report(runs, times, memory, label)


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
