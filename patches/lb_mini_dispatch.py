"""LB-Mini in verl's v1 trainer: under strategy=odc each rank gets an LB-Mini share of every step.

Stock verl 0.9.1 (`verl/trainer/ppo/v1/trainer_base.py`): `_step_once` balances the batch
(`_balance_batch`: padding, then dp equal-count workload-balanced partitions in order), and
every stage dispatches it with `make_nd_compute_dataproto_dispatch_fn` (`single_controller/base/
decorator.py`): equal contiguous chunks, one per rank; `TrainingWorker.train_mini_batch` cuts a
rank's chunk into one piece per optimizer step (`engine_workers.py`). This patch, for roles whose
engine strategy is `odc` with `odc_balancer=lb_mini`:

* the trainer methods of the stages, `_update_actor`, `_update_critic`,
  `_compute_old_log_prob`, `_compute_ref_log_prob` and `_compute_values`, attach a
  `PlanRequest` (the role's LB-Mini settings) to the batch's extra_info for the duration of the call;
  afterwards they log the plan's statistics (`odc_balance/*` for the actor's update, `odc_balance/<stage>/*`
  for the others, `plan_s` and `dispatch_s` the driver's seconds planning and splitting the batch by the
  plan) and, for an update, take the `auto` cost's fit from
  the metrics the engine reported (`<role>/odc/fit_*`) for the next plans, logged as `odc_balance/fit_*`,
  `rank_speed_min|max` and the plan's `prediction_error` (its predicted time over the measured one).
* the dispatch function of `ActorRolloutRefWorker.update_actor` (`workers/engine_workers.py`),
  `compute_log_prob` and `compute_ref_log_prob`, and of `TrainingWorker.train_mini_batch`
  and `infer_batch` (the critic's worker group): a batch carrying a request is planned there,
  in the driver, on exactly what verl would dispatch (`odc_plugin.verl.dispatch.split_by_plan`: verl's
  own chunks and mini-batch iterator give the steps, LB-Mini splits each step over the ranks) and each
  rank gets its samples and, per step, which of them it runs; anything else goes to verl's dispatch
  unchanged.

A mode's override of a stage method around a call of verl's (separate_async's `_compute_old_log_prob`,
`trainer_separate_async.py`, saves and restores the actor's weights around it) is wrapped whole: the
request is on the batch when the override reaches verl's method.

`PPOTrainer.init` first probes the losses of the roles on odc (`odc_plugin.verl.loss_check.check_losses`)
and refuses one that depends on how samples are packed into micro-batches, before any worker starts.

Both parts are members of the subclasses odc runs use (odc_patches.odc_subclass): the trainer of the run's
mode and the two worker classes, whose methods are registered again with the planning dispatch; verl's
own classes and dispatch dicts are never changed, and a run without odc uses them. Roles on fsdp/fsdp2 (or
odc with lb_micro) in an odc run get no request, and their calls go to verl's dispatch unchanged.

Why a patch: verl's dispatch functions are fixed per worker method when the class is defined
(`@register(dispatch_mode=...)`), and the trainer's stages have no hook between building a batch and
dispatching it; the subclasses override exactly those.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time

from odc_patches import PatchError, parameters, require_attr

NAME = "lb_mini_dispatch"

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))  # verl's own modules' convention

_SIGNATURES = {
    "init": ["self"],
    "_update_actor": ["self", "batch", "metrics"],
    "_update_critic": ["self", "batch", "metrics"],
    "_compute_old_log_prob": ["self", "batch", "metrics"],
    "_compute_ref_log_prob": ["self", "batch", "metrics"],
    "_compute_values": ["self", "batch", "metrics"],
}
# Names the stock trainer methods use; if one disappears the method was rewritten and the patch must be too.
_TRAINER_USES = {
    "init": ("_setup",),
    "_update_actor": ("update_actor", "extra_info"),
    "_update_critic": ("train_mini_batch", "extra_info"),
    "_compute_old_log_prob": ("compute_log_prob", "extra_info"),
    "_compute_ref_log_prob": ("compute_ref_log_prob", "compute_log_prob", "ref_in_actor", "extra_info"),
    "_compute_values": ("infer_batch", "extra_info"),
}
# Worker methods whose batches are dispatched by the plan, by kind of worker, and the mesh verl dispatches them on.
_DISPATCHED = {
    "actor_worker": (("update_actor", "actor"), ("compute_log_prob", "actor"), ("compute_ref_log_prob", "ref")),
    "training_worker": (("train_mini_batch", "train"), ("infer_batch", "train")),
}
# The trainer methods that carry a stage's plan request into their worker call: (method, stage).
_STAGES = (
    ("_update_actor", "actor"),
    ("_update_critic", "critic"),
    ("_compute_old_log_prob", "old_log_prob"),
    ("_compute_ref_log_prob", "ref_log_prob"),
    ("_compute_values", "values"),
)
_UPDATES = ("actor", "critic")


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------


MESH_TRAIN = "train"  # the mesh verl dispatches a TrainingWorker's batches on


def mesh_ranks(worker_group, mesh_name: str) -> list[int]:
    """Each worker's data-parallel rank on `mesh_name`, found as verl's dispatch_lazy_compute_data_proto finds it."""
    if mesh_name not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh_name] = worker_group._query_dispatch_info(mesh_name)
    return worker_group._dispatch_info[mesh_name]


def run_on_pieces(worker_group, method: str, mesh_name: str, pieces: list):
    """A worker method registered with verl's lazy nd dispatch on `mesh_name`, run on `pieces` (one per
    data-parallel rank, of any sizes) where verl would run it on equal chunks: verl's dispatch, execution and
    collection of the call, its output as verl's non-blocking call returns it."""
    from verl.single_controller.base.decorator import collect_lazy_compute_data_proto, dispatch_nd_compute

    ranks = mesh_ranks(worker_group, mesh_name)
    args, kwargs = dispatch_nd_compute(ranks, max(ranks) + 1, worker_group, pieces)
    output = worker_group.execute_all_async(method, *args, **kwargs)
    return collect_lazy_compute_data_proto(mesh_name, worker_group, output)


def _lb_mini_dispatch(mesh_name, stock_dispatch, worker_group, *args, **kwargs):
    """verl's lazy nd dispatch, except that a batch carrying an LB-Mini request is planned and split by it."""
    from verl.single_controller.base.decorator import dispatch_nd_compute

    from odc_plugin.verl.dispatch import PLAN_KEY, split_by_plan

    planned = [a for a in (*args, *kwargs.values()) if PLAN_KEY in (getattr(a, "extra_info", None) or {})]
    if not planned:
        return stock_dispatch(worker_group, *args, **kwargs)
    if len(args) + len(kwargs) != 1:
        raise ValueError(
            f"odc: a call carrying an LB-Mini plan request takes exactly one batch argument, got "
            f"{len(args)} positional and {sorted(kwargs)}"
        )
    dp_rank_mapping = mesh_ranks(worker_group, mesh_name)
    dp_size = max(dp_rank_mapping) + 1
    start, request = time.perf_counter(), planned[0].extra_info[PLAN_KEY]
    pieces = split_by_plan(planned[0], dp_size)
    if args:
        out = dispatch_nd_compute(dp_rank_mapping, dp_size, worker_group, pieces)
    else:
        out = dispatch_nd_compute(dp_rank_mapping, dp_size, worker_group, **{next(iter(kwargs)): pieces})
    request.dispatch_s = time.perf_counter() - start - request.plan_s
    return out


def _collect_once(stock_collect, worker_group, output):
    """verl's collect of a planned call, each split sample's outputs taken from its group's first member."""
    from odc_plugin.verl.dispatch import collect_once

    return stock_collect(worker_group, collect_once(output))


def check_dispatch() -> None:
    """What _lb_mini_dispatch and run_on_pieces call of verl's, as they call it."""
    from verl.single_controller.base import decorator
    from verl.single_controller.base.worker import Worker
    from verl.single_controller.ray.base import RayWorkerGroup

    # what both call in place of dispatch_lazy_compute_data_proto's chunking
    nd_compute = require_attr(decorator, "dispatch_nd_compute", NAME)
    if parameters(nd_compute) != ["dp_rank_mapping", "dp_size", "worker_group", "args", "kwargs"]:
        raise PatchError(f"odc patch '{NAME}': dispatch_nd_compute{inspect.signature(nd_compute)} changed")
    collect = require_attr(decorator, "collect_lazy_compute_data_proto", NAME)
    if parameters(collect)[:2] != ["mesh_name", "worker_group"]:
        raise PatchError(f"odc patch '{NAME}': collect_lazy_compute_data_proto{inspect.signature(collect)} changed")
    require_attr(RayWorkerGroup, "execute_all_async", NAME)
    require_attr(Worker, "_query_dispatch_info", NAME)  # bound onto every worker group, used as verl uses it


def _planned(cls_name: str, method_name: str, method, mesh: str):
    """A worker method, checked to be registered with verl's lazy nd dispatch on `mesh`, as a subclass's
    method registered with the same settings but _lb_mini_dispatch in front of verl's dispatch."""
    from verl.single_controller.base.decorator import MAGIC_ATTR, dispatch_lazy_compute_data_proto

    attrs = getattr(method, MAGIC_ATTR, None) or {}
    mode = attrs.get("dispatch_mode")
    if not isinstance(mode, dict) or "dispatch_fn" not in mode or "collect_fn" not in mode:
        raise PatchError(f"odc patch '{NAME}': {cls_name}.{method_name} is no longer registered with a dispatch dict")
    dispatch = mode["dispatch_fn"]
    if not (
        isinstance(dispatch, functools.partial)
        and dispatch.func is dispatch_lazy_compute_data_proto
        and dispatch.args == (mesh,)
    ):
        raise PatchError(
            f"odc patch '{NAME}': {cls_name}.{method_name} is no longer dispatched by "
            f"dispatch_lazy_compute_data_proto on mesh '{mesh}'"
        )

    @functools.wraps(method)
    def planned(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    # the driver's worker group reads the dispatch from here; the worker runs verl's method as registered
    setattr(
        planned,
        MAGIC_ATTR,
        {
            **attrs,
            "dispatch_mode": {
                "dispatch_fn": functools.partial(_lb_mini_dispatch, mesh, dispatch),
                "collect_fn": functools.partial(_collect_once, mode["collect_fn"]),
            },
        },
    )
    return planned


# ---------------------------------------------------------------------------------------------
# trainer
# ---------------------------------------------------------------------------------------------


def _stage_settings(trainer, stage: str):
    """LB-Mini settings of a stage (cached on the trainer), None for verl's equal split.

    Stages: "actor" and "critic" (updates), "old_log_prob", "ref_log_prob" and "values" (forward-only
    passes, planned with their role's training fit).
    """
    cache = trainer.__dict__.setdefault("_odc_lb_mini_settings", {})
    if stage in cache:
        return cache[stage]
    from verl.utils.config import omega_conf_to_dataclass

    from odc_plugin.verl.dispatch import actor_packing, critic_packing, lb_mini_settings

    config = trainer.config
    roles = config.actor_rollout_ref
    settings = None
    if stage == "actor" and roles.actor.get("strategy") == "odc":
        actor = omega_conf_to_dataclass(roles.actor)
        settings = lb_mini_settings(
            actor.engine,
            **dataclasses.asdict(actor_packing(actor)),
            model_config=lambda: omega_conf_to_dataclass(roles.model).hf_config,
            gpus_per_node=config.trainer.n_gpus_per_node,  # a split's groups stay inside a node
        )
    elif stage == "critic" and config.critic.get("strategy") == "odc":
        critic = omega_conf_to_dataclass(config.critic)
        settings = lb_mini_settings(
            critic.engine,
            **dataclasses.asdict(critic_packing(critic)),
            model_config=lambda: critic.model.hf_config,
            gpus_per_node=config.trainer.n_gpus_per_node,
        )
    elif stage == "old_log_prob" or (stage == "ref_log_prob" and trainer.ref_in_actor):
        actor = _stage_settings(trainer, "actor")
        # the actor engine's inference budget (engine_workers.py)
        settings = actor and actor.for_inference(
            roles.rollout.log_prob_max_token_len_per_gpu if actor.max_token_len else None,
            None if actor.max_token_len else roles.rollout.log_prob_micro_batch_size_per_gpu,
            actor.ulysses,
        )
    elif stage == "ref_log_prob" and roles.ref.get("strategy") == "odc":
        ref = roles.ref
        # what init_model gives the reference engine (engine_workers.py); the actor's fit, same model
        engine = omega_conf_to_dataclass(ref.fsdp_config)
        object.__setattr__(engine, "strategy", ref.strategy)  # as verl's FSDPActorConfig does (actor.py)
        own = lb_mini_settings(
            engine,
            use_dynamic_bsz=ref.get("log_prob_use_dynamic_bsz", False),
            max_token_len=ref.get("log_prob_max_token_len_per_gpu"),
            micro_batch_size=ref.get("log_prob_micro_batch_size_per_gpu"),
            model_config=lambda: omega_conf_to_dataclass(roles.model).hf_config,
            gpus_per_node=config.trainer.n_gpus_per_node,
        )
        actor = _stage_settings(trainer, "actor")
        settings = own and (actor or own).for_inference(own.max_token_len, own.micro_batch_size, own.ulysses)
    elif stage == "values":
        critic = _stage_settings(trainer, "critic")
        # verl gives the critic's engine one budget for both (trainer_base.py)
        settings = critic and critic.for_inference(critic.max_token_len, critic.micro_batch_size, critic.ulysses)
    cache[stage] = settings
    return settings


def _check_losses(trainer) -> None:
    """Refuse, once per trainer, a role's loss that depends on how strategy=odc packs its mini-batches
    (odc_plugin.verl.loss_check.check_losses), logging what the probe found and its time."""
    from odc_plugin.verl.loss_check import check_losses

    start = time.perf_counter()
    verdicts = check_losses(trainer.config)
    if verdicts:
        logger.log(
            logging.INFO if all(v.invariant for v in verdicts.values()) else logging.WARNING,
            "odc: losses probed in %.2f s: %s",
            time.perf_counter() - start,
            "; ".join(
                f"{role} {'packing-invariant' if v.invariant else 'packing-dependent, packed as under fsdp2'}"
                for role, v in verdicts.items()
            ),
        )


def _wrap_init(stock):
    """`PPOTrainer.init`, refusing a packing-dependent loss before any worker starts."""

    @functools.wraps(stock)
    def _init(self):
        _check_losses(self)
        return stock(self)

    return _init


# Where a stage's plan statistics go in the step's metrics.
_METRICS_PREFIX = {
    "actor": "odc_balance",
    "critic": "odc_balance/critic",
    "old_log_prob": "odc_balance/old_log_prob",
    "ref_log_prob": "odc_balance/ref_log_prob",
    "values": "odc_balance/values",
}


def _wrap_stage(stock, stage: str):
    """The trainer method of `stage`, with the stage's plan request in the batch's extra_info for the call;
    afterwards the plan's statistics go to the step's metrics, and an update hands the metrics its engine
    reported to the stage's auto cost."""

    @functools.wraps(stock)
    def _run(self, batch, metrics):
        from odc_plugin.verl.dispatch import PLAN_KEY, PlanRequest, plan_metrics, plan_seconds

        settings = _stage_settings(self, stage)
        if settings is None:
            return stock(self, batch, metrics)
        request = PlanRequest(settings, update=stage in _UPDATES)
        if batch.extra_info is None:
            batch.extra_info = {}
        batch.extra_info[PLAN_KEY] = request
        try:
            out = stock(self, batch, metrics)
        finally:
            batch.extra_info.pop(PLAN_KEY, None)
        if request.plan is None:
            return out  # nothing was dispatched (old log-probs taken from the rollout: bypass mode)
        prefix = _METRICS_PREFIX[stage]
        metrics.update(plan_metrics(request.plan, request.seqlens, settings.cost, prefix))
        metrics[f"{prefix}/plan_s"] = request.plan_s
        metrics[f"{prefix}/dispatch_s"] = request.dispatch_s
        if stage in _UPDATES:
            observed = settings.observe(metrics, f"{stage}/", request.plan, request.seqlens)
            measured = metrics.get(f"{stage}/odc/compute_s_max")
            if request.fit is not None and measured:
                predicted = plan_seconds(request.plan, request.seqlens, request.fit)
                # the plan's predicted time of its slowest rank over the slowest rank's measured compute
                observed["prediction_error"] = sum(predicted) / len(predicted) / measured - 1
            metrics.update({f"{prefix}/{k}": v for k, v in observed.items()})
        return out

    return _run


def _check_trainer(trainer: type) -> None:
    """The stage methods of verl's trainer class, checked to be what _wrap_stage wraps: each makes its worker
    call with the batch, itself or, where a mode overrides it around a call of super()'s (separate_async's
    `_compute_old_log_prob` saves and restores the actor's weights around it), the nearest base method that does."""
    for name, params in _SIGNATURES.items():
        fn = require_attr(trainer, name, NAME)
        if parameters(fn) != params:
            raise PatchError(
                f"odc patch '{NAME}': {trainer.__name__}.{name}({', '.join(parameters(fn))}) is no longer "
                f"({', '.join(params)})"
            )
        for owner in (k for k in trainer.__mro__ if name in vars(k)):
            code = vars(owner)[name].__code__
            missing = [n for n in _TRAINER_USES[name] if n not in code.co_names]
            if not missing or not {"super", name} <= set(code.co_names):
                break
        if missing:
            raise PatchError(
                f"odc patch '{NAME}': {owner.__name__}.{name} no longer uses {missing}; it was rewritten, "
                f"re-check the patch"
            )


def extend(kind: str, base: type, members: dict) -> None:
    """The trainer's stage methods (kind "trainer"), or the worker methods the plan dispatches."""
    if kind == "trainer":
        _check_trainer(base)
        members["init"] = _wrap_init(base.init)
        for method, stage in _STAGES:
            members[method] = _wrap_stage(getattr(base, method), stage)
        return
    check_dispatch()
    for method, mesh in _DISPATCHED.get(kind, ()):
        current = members.get(method) or require_attr(base, method, NAME)
        members[method] = _planned(base.__name__, method, current, mesh)
