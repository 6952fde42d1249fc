"""odc-grpo-cpu's runs as hydra overrides of verl's PPO trainer: what every run shares, what sets each
run apart, and verl's own checks of the composed configuration before any run starts."""

from __future__ import annotations

import os

from . import EMULATION_ENV, PLATFORM_ENV, SLOW_RANKS_ENV
from .assets import Assets
from .emulation import Emulation

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
# baseline), odc_lb_micro is ODC on verl's equal split; so run to run each factor of odc-demo's rows; split
# is odc with odc_split=auto.
RUNS = {
    "fsdp2": ("fsdp2", []),
    "lockstep": ("odc", [*ODC_OPTIONS, *_every_engine("odc_balancer=lb_micro", "odc_lockstep=True")]),
    "odc_lb_micro": ("odc", [*ODC_OPTIONS, *_every_engine("odc_balancer=lb_micro")]),
    "odc": ("odc", []),
    # odc with the longest samples of every pass split over groups of ranks
    "split": ("odc", [*ODC_OPTIONS, *_every_engine("odc_split=auto")]),
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


# GRPO responses per prompt. Prompt tokens allowed: the data's longest prompt has 69; an emulated run's
# micro-batch budget just holds the longest sample, as odc-demo's rl case does.
GROUP_SIZE, MAX_PROMPT_TOKENS, LONGEST_PROMPT = 4, 96, 72
# A vision-language model's job, as verl's geo3k example sets it: the data set's images; its processor is
# remote code shipped with the tiny model (vl_processor.py says why)
VISION_LANGUAGE = ["data.image_key=images", "actor_rollout_ref.model.trust_remote_code=True"]
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
        *(VISION_LANGUAGE if assets.vision_language else []),
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
