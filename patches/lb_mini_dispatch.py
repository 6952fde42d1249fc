"""LB-Mini in verl's v1 trainer: each rank gets an LB-Mini share of every mini-batch.

Stock verl 0.9.1 (`verl/trainer/ppo/v1/trainer_base.py`): `_step_once` (582) calls
`_balance_batch` (1608-1632), which pads the batch and reorders it into `dp` equal-count,
workload-balanced partitions; every stage then dispatches the whole batch with
`make_nd_compute_dataproto_dispatch_fn` (`single_controller/base/decorator.py:300`), i.e. equal
contiguous chunks, one per rank, and `TrainingWorker.train_mini_batch` cuts each chunk into equal
mini-batch pieces. This patch, for roles whose engine strategy is `odc` with `odc_balancer=lb_mini`:

* `PPOTrainer._balance_batch` (trainer_base.py:1608): runs verl's own (padding, the equal-count order
  the inference stages keep, the `global_seqlen/*` metrics), then plans each update: mini-batch i is
  the i-th consecutive slice of the batch in the order the trainer received it (plus verl's padding
  samples last), split over ranks with LB-Mini (`odc_plugin.verl.dispatch.plan_mini_batches`). The
  plans are kept on the trainer; their statistics go to the step's metrics as `odc_balance/*`
  (actor) and `odc_balance/critic/*`.
* `PPOTrainer._update_actor` (1827) / `_update_critic` (1804): put the role's plan into the batch's
  extra_info for the duration of the update call.
* the forward-only passes of those roles are planned too, the whole batch as one mini-batch: the
  actor's old log-probs, the reference log-probs (the reference model's engine, or the actor's when
  the reference lives in it) and the critic's values. `_compute_old_log_prob` (1634),
  `_compute_ref_log_prob` (1695) and `_compute_values` (1721) put their plan into extra_info for the
  call; each rank computes its share, and verl writes the results back by sample key, so they land
  in the batch's order whatever the split.
* `_update_actor` / `_update_critic` also read the `auto` cost's fit from the metrics the engine
  reported (`<role>/odc/fit_*`) for the next step's plans, and log it as `odc_balance/fit_*`,
  `rank_speed_min|max` and the plan's `prediction_error` (its predicted time over the measured one).
* the dispatch function of `ActorRolloutRefWorker.update_actor` (`workers/engine_workers.py:708`),
  `compute_log_prob` (700) and `compute_ref_log_prob` (693), and of `TrainingWorker.train_mini_batch`
  (243) and `infer_batch` (397; the critic's worker group): a batch carrying a plan is split by it
  (`split_by_plan`: each rank its samples rank-major and its per-mini-batch counts) instead of into
  equal chunks; anything else goes to verl's dispatch unchanged.

Roles on fsdp/fsdp2 (or odc with lb_micro) get no plan, so every stock run is unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging

from odc_patches import PatchError, require_attr, require_verl_version

VERL_VERSION = "0.9.1"
NAME = "lb_mini_dispatch"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
# The dispatch runs in the trainer's (driver) process, which imports the trainer before building worker groups.
TARGET = TRAINER_MODULE

logger = logging.getLogger(__name__)

# Why the trainer part was not applied (None when it was): verl's v1 trainer cannot be imported without
# the TransferQueue package, and then there is no v1 trainer to patch.
TRAINER_SKIPPED: str | None = None

_SIGNATURES = {
    "_balance_batch": ["self", "batch", "metrics", "logging_prefix", "keep_minibatch"],
    "_update_actor": ["self", "batch", "metrics"],
    "_update_critic": ["self", "batch", "metrics"],
    "_compute_old_log_prob": ["self", "batch", "metrics"],
    "_compute_ref_log_prob": ["self", "batch", "metrics"],
    "_compute_values": ["self", "batch", "metrics"],
}
# Names the stock trainer methods use; if one disappears the method was rewritten and the patch must be too.
_TRAINER_USES = {
    "_balance_batch": ("_dispatch_info", "_query_dispatch_info", "upsample_batch_to_divisible_size"),
    "_update_actor": ("update_actor", "extra_info"),
    "_update_critic": ("train_mini_batch", "extra_info"),
    "_compute_old_log_prob": ("compute_log_prob", "extra_info"),
    "_compute_ref_log_prob": ("compute_ref_log_prob", "compute_log_prob", "ref_in_actor", "extra_info"),
    "_compute_values": ("infer_batch", "extra_info"),
}
# Worker methods whose batches are dispatched by the plan, and the mesh verl dispatches them on.
_DISPATCHED = (
    ("ActorRolloutRefWorker", "update_actor", "actor"),
    ("ActorRolloutRefWorker", "compute_log_prob", "actor"),
    ("ActorRolloutRefWorker", "compute_ref_log_prob", "ref"),
    ("TrainingWorker", "train_mini_batch", "train"),
    ("TrainingWorker", "infer_batch", "train"),
)
# The trainer methods that carry a stage's plan into their worker call: (method, stage).
_STAGES = (
    ("_update_actor", "actor"),
    ("_update_critic", "critic"),
    ("_compute_old_log_prob", "old_log_prob"),
    ("_compute_ref_log_prob", "ref_log_prob"),
    ("_compute_values", "values"),
)


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------


def _lb_mini_dispatch(mesh_name, stock_dispatch, worker_group, *args, **kwargs):
    """verl's lazy nd dispatch, except that a batch carrying an LB-Mini plan is split by the plan."""
    from verl.single_controller.base.decorator import dispatch_nd_compute

    from odc_plugin.verl.dispatch import PLAN_KEY, split_by_plan

    planned = [a for a in (*args, *kwargs.values()) if PLAN_KEY in (getattr(a, "extra_info", None) or {})]
    if not planned:
        return stock_dispatch(worker_group, *args, **kwargs)
    if len(args) + len(kwargs) != 1:
        raise ValueError(
            f"odc: an update carrying an LB-Mini plan takes exactly one batch argument, got "
            f"{len(args)} positional and {sorted(kwargs)}"
        )
    # as verl's dispatch_lazy_compute_data_proto finds the ranks of the mesh
    if mesh_name not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh_name] = worker_group._query_dispatch_info(mesh_name)
    dp_rank_mapping = worker_group._dispatch_info[mesh_name]
    dp_size = max(dp_rank_mapping) + 1
    pieces = split_by_plan(planned[0], dp_size)
    if args:
        return dispatch_nd_compute(dp_rank_mapping, dp_size, worker_group, pieces)
    return dispatch_nd_compute(dp_rank_mapping, dp_size, worker_group, **{next(iter(kwargs)): pieces})


def _dispatch_dicts():
    """The dispatch dicts verl registered the update methods with, checked to be what this patch wraps."""
    from verl.single_controller.base import decorator
    from verl.single_controller.base.decorator import (
        MAGIC_ATTR,
        dispatch_lazy_compute_data_proto,
    )
    from verl.single_controller.base.worker import Worker
    from verl.workers import engine_workers

    # what _lb_mini_dispatch calls in place of dispatch_lazy_compute_data_proto's chunking
    nd_compute = require_attr(decorator, "dispatch_nd_compute", NAME)
    params = list(inspect.signature(nd_compute).parameters)
    if params != ["dp_rank_mapping", "dp_size", "worker_group", "args", "kwargs"]:
        raise PatchError(f"odc patch '{NAME}': dispatch_nd_compute{inspect.signature(nd_compute)} changed")
    require_attr(Worker, "_query_dispatch_info", NAME)  # bound onto every worker group, used as verl uses it

    found = []
    for cls_name, method, mesh in _DISPATCHED:
        fn = require_attr(require_attr(engine_workers, cls_name, NAME), method, NAME)
        mode = (getattr(fn, MAGIC_ATTR, None) or {}).get("dispatch_mode")
        if not isinstance(mode, dict) or "dispatch_fn" not in mode or "collect_fn" not in mode:
            raise PatchError(f"odc patch '{NAME}': {cls_name}.{method} is no longer registered with a dispatch dict")
        dispatch = mode["dispatch_fn"]
        if isinstance(dispatch, functools.partial) and dispatch.func is _lb_mini_dispatch:
            found.append((mode, None))  # already patched
            continue
        if not (
            isinstance(dispatch, functools.partial)
            and dispatch.func is dispatch_lazy_compute_data_proto
            and dispatch.args == (mesh,)
        ):
            raise PatchError(
                f"odc patch '{NAME}': {cls_name}.{method} is no longer dispatched by "
                f"dispatch_lazy_compute_data_proto on mesh '{mesh}'"
            )
        found.append((mode, mesh))
    return found


# ---------------------------------------------------------------------------------------------
# trainer
# ---------------------------------------------------------------------------------------------


def _stage_settings(trainer, stage: str):
    """LB-Mini settings of a stage (cached on the trainer), None for verl's equal split.

    Stages: "actor" and "critic" (updates), "old_log_prob", "ref_log_prob" and "values" (forward-only
    passes, planned with their role's training fit).

    Long because it is one branch per stage, each reading that stage's keys from verl's config.
    """
    cache = trainer.__dict__.setdefault("_odc_lb_mini_settings", {})
    if stage in cache:
        return cache[stage]
    from verl.utils.config import omega_conf_to_dataclass

    from odc_plugin.verl.dispatch import lb_mini_settings

    config = trainer.config
    roles = config.actor_rollout_ref
    settings = None
    if stage == "actor" and roles.actor.get("strategy") == "odc":
        actor = omega_conf_to_dataclass(roles.actor)
        # what ActorRolloutRefWorker.init_model gives the actor's engine (engine_workers.py:619-628)
        settings = lb_mini_settings(
            actor.engine,
            # the global mini-batch size _update_actor puts in extra_info (trainer_base.py:1829-1830)
            mini_batch_size=roles.actor.ppo_mini_batch_size * roles.rollout.n,
            use_dynamic_bsz=actor.use_dynamic_bsz,
            max_token_len=actor.ppo_max_token_len_per_gpu,
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
            model_config=lambda: omega_conf_to_dataclass(roles.model).hf_config,
        )
    elif stage == "critic" and config.critic.get("strategy") == "odc":
        critic = omega_conf_to_dataclass(config.critic)
        # what PPOTrainer._setup gives the critic's engine (trainer_base.py:266-268)
        settings = lb_mini_settings(
            critic.engine,
            mini_batch_size=config.critic.ppo_mini_batch_size * roles.rollout.n,  # as _update_critic (1806-1807)
            use_dynamic_bsz=critic.engine.use_dynamic_bsz,
            max_token_len=critic.ppo_infer_max_token_len_per_gpu,
            micro_batch_size=critic.engine.micro_batch_size_per_gpu,
            model_config=lambda: critic.model.hf_config,
        )
    elif stage == "old_log_prob" or (stage == "ref_log_prob" and trainer.ref_in_actor):
        actor = _stage_settings(trainer, "actor")
        # the actor engine's inference budget (engine_workers.py:619-624)
        settings = actor and actor.for_inference(
            roles.rollout.log_prob_max_token_len_per_gpu if actor.max_token_len else None,
            None if actor.max_token_len else roles.rollout.log_prob_micro_batch_size_per_gpu,
        )
    elif stage == "ref_log_prob" and roles.ref.get("strategy") == "odc":
        ref = roles.ref
        # what init_model gives the reference engine (engine_workers.py:545-584); the actor's fit, same model
        engine = omega_conf_to_dataclass(ref.fsdp_config)
        object.__setattr__(engine, "strategy", ref.strategy)  # as verl's FSDPActorConfig does (actor.py:321-325)
        own = lb_mini_settings(
            engine,
            mini_batch_size=1,
            use_dynamic_bsz=ref.get("log_prob_use_dynamic_bsz", False),
            max_token_len=ref.get("log_prob_max_token_len_per_gpu"),
            micro_batch_size=ref.get("log_prob_micro_batch_size_per_gpu"),
            model_config=lambda: omega_conf_to_dataclass(roles.model).hf_config,
        )
        actor = _stage_settings(trainer, "actor")
        settings = own and (actor or own).for_inference(own.max_token_len, own.micro_batch_size)
    elif stage == "values":
        critic = _stage_settings(trainer, "critic")
        # verl gives the critic's engine one budget for both (trainer_base.py:266-268)
        settings = critic and critic.for_inference(critic.max_token_len, critic.micro_batch_size)
    cache[stage] = settings
    return settings


def _dp_size(worker_group, mesh: str) -> int:
    if mesh not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh] = worker_group._query_dispatch_info(mesh)
    return max(worker_group._dispatch_info[mesh]) + 1


def _stages_this_step(trainer):
    """(stage, settings, worker group, mesh) of the LB-Mini stages this step runs."""
    candidates = [("old_log_prob", trainer.actor_rollout_wg, "actor")]
    if trainer.use_reference_policy:
        candidates.append(
            (
                "ref_log_prob",
                *((trainer.actor_rollout_wg, "actor") if trainer.ref_in_actor else (trainer.ref_policy_wg, "ref")),
            )
        )
    if trainer.use_critic:
        candidates += [("values", trainer.critic_wg, "train"), ("critic", trainer.critic_wg, "train")]
    # the same condition verl's _get_required_batch_multiple pads for (trainer_base.py:1589-1606)
    if trainer.config.trainer.critic_warmup <= trainer.global_steps:
        candidates.append(("actor", trainer.actor_rollout_wg, "actor"))
    stages = []
    for stage, worker_group, mesh in candidates:
        settings = _stage_settings(trainer, stage)
        if settings is not None:
            stages.append((stage, settings, worker_group, mesh))
    return stages


# Where a stage's plan statistics go in the step's metrics.
_METRICS_PREFIX = {
    "actor": "odc_balance",
    "critic": "odc_balance/critic",
    "old_log_prob": "odc_balance/old_log_prob",
    "ref_log_prob": "odc_balance/ref_log_prob",
    "values": "odc_balance/values",
}


def _wrap_balance_batch(stock):
    @functools.wraps(stock)
    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        self._odc_lb_mini_plans = {}
        stages = _stages_this_step(self)
        if not stages:
            return stock(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        from odc_plugin.verl.dispatch import plan_metrics, plan_payload, plan_seconds

        arrival = list(batch.keys)
        balanced = stock(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        # verl appends its padding samples to the batch before reordering it
        known = set(arrival)
        keys = arrival + [k for k in balanced.keys if k not in known]
        tag_of = dict(zip(balanced.keys, balanced.tags))
        seqlens = [int(tag_of[k]["seq_len"]) for k in keys]
        for stage, settings, worker_group, mesh in stages:
            plan = settings.plan(seqlens, _dp_size(worker_group, mesh))
            fit = settings.current_fit
            self._odc_lb_mini_plans[stage] = (
                plan_payload(plan, keys),
                fit and len(fit.speeds) == plan.dp_size and plan_seconds(plan, seqlens, fit),
            )
            metrics.update(plan_metrics(plan, seqlens, settings.cost, _METRICS_PREFIX[stage]))
        return balanced

    _balance_batch._odc_patched = True
    return _balance_batch


def _wrap_stage(stock, stage: str):
    """The trainer method of `stage`, with the stage's plan in the batch's extra_info for the call; an
    update then hands the metrics its engine reported to the stage's auto cost."""

    @functools.wraps(stock)
    def _run(self, batch, metrics):
        from odc_plugin.verl.dispatch import PLAN_KEY

        payload, predicted = (getattr(self, "_odc_lb_mini_plans", None) or {}).pop(stage, (None, None))
        if payload is None:
            return stock(self, batch, metrics)
        if batch.extra_info is None:
            batch.extra_info = {}
        batch.extra_info[PLAN_KEY] = payload
        try:
            out = stock(self, batch, metrics)
        finally:
            batch.extra_info.pop(PLAN_KEY, None)
        if stage in ("actor", "critic"):
            observed = _stage_settings(self, stage).observe(metrics, stage)
            measured = metrics.get(f"{stage}/odc/compute_s_max")
            if predicted and measured:
                # the plan's predicted time of its slowest rank over the slowest rank's measured compute
                observed["prediction_error"] = sum(predicted) / len(predicted) / measured - 1
            metrics.update({f"{_METRICS_PREFIX[stage]}/{k}": v for k, v in observed.items()})
        return out

    _run._odc_patched = True
    return _run


def _trainer_class():
    """verl's v1 PPOTrainer, checked; None (with TRAINER_SKIPPED set) when TransferQueue is missing."""
    global TRAINER_SKIPPED
    if importlib.util.find_spec("transfer_queue") is None:
        TRAINER_SKIPPED = (
            "the TransferQueue package is not installed, so verl's v1 trainer cannot run here "
            "and there is nothing to patch"
        )
        logger.warning("odc patch '%s': trainer part not applied: %s", NAME, TRAINER_SKIPPED)
        return None
    TRAINER_SKIPPED = None
    try:
        module = importlib.import_module(TRAINER_MODULE)
    except ImportError as e:
        raise PatchError(f"odc patch '{NAME}': cannot import {TRAINER_MODULE}: {e!r}") from e
    trainer = require_attr(module, "PPOTrainer", NAME)
    for name, params in _SIGNATURES.items():
        fn = require_attr(trainer, name, NAME)
        if getattr(fn, "_odc_patched", False):
            continue
        if list(inspect.signature(fn).parameters) != params:
            raise PatchError(
                f"odc patch '{NAME}': PPOTrainer.{name}{inspect.signature(fn)} is no longer ({', '.join(params)})"
            )
        missing = [n for n in _TRAINER_USES[name] if n not in fn.__code__.co_names]
        if missing:
            raise PatchError(
                f"odc patch '{NAME}': PPOTrainer.{name} no longer uses {missing}; it was rewritten, re-check the patch"
            )
    return trainer


def apply() -> None:
    require_verl_version(NAME, VERL_VERSION)
    # check everything before changing anything
    dispatch_dicts = _dispatch_dicts()
    trainer = _trainer_class()
    for mode, mesh in dispatch_dicts:
        if mesh is not None:
            mode["dispatch_fn"] = functools.partial(_lb_mini_dispatch, mesh, mode["dispatch_fn"])
    if trainer is None:
        return
    if not getattr(trainer._balance_batch, "_odc_patched", False):
        trainer._balance_batch = _wrap_balance_batch(trainer._balance_batch)
    for method, stage in _STAGES:
        if not getattr(getattr(trainer, method), "_odc_patched", False):
            setattr(trainer, method, _wrap_stage(getattr(trainer, method), stage))
