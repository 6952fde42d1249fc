"""LB-Mini dispatch: how one batch becomes every rank's share of every optimizer step.

Stock verl (the v1 trainer, `strategy=fsdp2`) dispatches a batch to the data-parallel ranks as equal
contiguous chunks, in the order `_balance_batch` gave it, and each rank's `train_mini_batch` cuts its
chunk into one piece per optimizer step with verl's `make_iterator`: `mini_batch_size // dp` samples a
piece, `epochs` passes, reshuffled every epoch from `seed + dp rank` when `shuffle` is on. The samples
optimizer step s trains on are the union of the ranks' pieces for step s.

Under `strategy=odc` ranks only meet at the end of a mini-batch, so for each call the dispatch
1. computes exactly those steps, with verl's own chunking and `make_iterator` run on the batch's
   positions and the `extra_info` the trainer set for the call (`verl_steps`): every optimizer step
   trains on the samples it trains on under fsdp2, in the same order of steps;
2. splits each step's samples over the ranks with LB-Mini (`odc_plugin.balance.lb_mini`), which keeps
   verl's own pieces unless its split is predicted to be really faster; counts may then differ, and
   every rank keeps at least one sample of every step;
3. sends each rank the samples it needs, each once, and for every step the indices of those it trains
   on (`STEPS_KEY`).
A forward-only pass (old log-probs, reference log-probs, values) is one step over the whole batch; each
rank computes its share and verl writes the results back by sample key; a sample split over a group is
computed by every member, and its output taken from the first (`collect_once`).

This module is the planning (the steps, the plans, the split of a batch's metadata, the metrics, a role's
packing); the verl patches that use it are `patches/lb_mini_dispatch.py` (trainer and dispatch) and
`patches/lb_mini_worker.py` (`TrainingWorker.train_mini_batch`). The loss check is `loss_check.py`.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from odc_plugin.balance import CostModel, balance_efficiency, get_cost_model, lb_mini
from odc_plugin.balance.lb_micro import verl_micro_batches
from odc_plugin.balance.lb_mini import MIN_GAIN
from odc_plugin.balance.online_fit import TimeFit
from odc_plugin.balance.split import Split, UlyssesModel, lb_mini_split

# extra_info entry the trainer sets on the batch of one call (a PlanRequest); only the dispatch reads it.
PLAN_KEY = "odc_lb_mini_request"
# extra_info entry each rank receives instead: for every optimizer step, the indices of its samples it
# trains on in that step.
STEPS_KEY = "odc_mini_batch_steps"
# with odc_split, for every step the groups of ranks of the rank's leading (split) samples of that step
SPLIT_STEPS_KEY = "odc_split_steps"

# The actor's keys in verl's trainer config.
ACTOR = "actor_rollout_ref.actor"

# steps[s][r]: the batch positions rank r runs in step s.
Steps = list[list[list[int]]]


def verl_steps(meta, dp_size: int, update: bool) -> Steps:
    """The steps stock verl runs on the batch `meta` (a KVBatchMeta) dispatched over `dp_size` ranks.

    The ranks' chunks are `meta.chunk(dp_size)`: what verl's dispatch hands each rank (it turns the
    KVBatchMeta into a BatchMeta, whose chunk follows the same contiguous rule). An update then cuts each
    chunk with verl's `make_iterator`, called as `TrainingWorker.train_mini_batch` calls it, with the
    `mini_batch_size` (or `num_mini_batch`), `epochs`, `seed` and `dataloader_kwargs` of the batch's
    extra_info (patches/lb_mini_worker.py checks that verl still calls it so). A forward-only pass is one
    step: the chunks themselves.
    """
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    position = {key: p for p, key in enumerate(meta.keys)}
    chunks = [[position[key] for key in chunk.keys] for chunk in meta.chunk(dp_size)]
    if not update:
        return [chunks]
    extra = meta.extra_info or {}
    mini_batch_size, num_mini_batch = extra.get("mini_batch_size"), extra.get("num_mini_batch")
    if mini_batch_size is None and num_mini_batch is None:
        raise ValueError("odc: an update's extra_info gives neither mini_batch_size nor num_mini_batch")
    if mini_batch_size is not None and mini_batch_size % dp_size:
        raise ValueError(f"odc: mini_batch_size={mini_batch_size} does not divide over {dp_size} ranks")
    per_rank = mini_batch_size // dp_size if mini_batch_size is not None else len(chunks[0]) // num_mini_batch
    pieces = []
    for rank, chunk in enumerate(chunks):
        positions = TensorDict({"position": torch.tensor(chunk, dtype=torch.long)}, batch_size=[len(chunk)])
        iterator = tu.make_iterator(
            positions,
            mini_batch_size=per_rank,
            epochs=extra.get("epochs", 1),
            seed=extra.get("seed", 42) + rank,
            dataloader_kwargs=extra.get("dataloader_kwargs") or {},
        )
        pieces.append([piece["position"].tolist() for piece in iterator])
    return [list(step) for step in zip(*pieces)]


@dataclass(frozen=True)
class StepPlan:
    """Where every sample goes in every step of one call.

    steps[s][r]: batch positions rank r runs in step s (each step's positions once over its ranks);
    micro_batches[s][r]: the micro-batches the engine runs for that share: LB-Mini packs it with verl's
        own functions, as the engine does (odc_plugin.balance.lb_micro.verl_micro_batches), and one for
        each split sample of the rank's groups;
    splits[s]: with `odc_split`, the samples of step s split over groups of ranks (Split.sample a batch
        position), each run first, in this order, on every rank of its group; not in steps[s];
    predicted[s]: with `odc_split`, the planner's time of step s with its splits and LB-Mini's without, in
        seconds, or in the cost's units where `predicted_in_seconds` is False (a static cost before the
        engine has measured its throughput).
    """

    steps: tuple[tuple[tuple[int, ...], ...], ...]
    micro_batches: tuple[tuple[int, ...], ...]
    splits: tuple[tuple[Split, ...], ...] = ()
    predicted: tuple[tuple[float, float], ...] = ()
    predicted_in_seconds: bool = True

    @property
    def dp_size(self) -> int:
        return len(self.steps[0])

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def split_share(self, step: int, rank: int) -> tuple[list[int], list[list[int]]]:
        """The batch positions `rank` runs in `step`, the split samples of its groups first, and the group of
        ranks of each of those split samples."""
        mine = [s for s in self.splits[step] if rank in s.group] if self.splits else []
        return [s.sample for s in mine] + list(self.steps[step][rank]), [list(s.group) for s in mine]

    def rank_items(self, step: int, rank: int, values: Sequence[float]) -> list[float]:
        """`values` (by batch position) of what `rank` runs in `step`: a k-th of each split sample's of its
        groups, then its own samples'."""
        pieces = [values[s.sample] / s.k for s in (self.splits[step] if self.splits else ()) if rank in s.group]
        return pieces + [values[p] for p in self.steps[step][rank]]

    def rank_positions(self, rank: int) -> list[int]:
        """The batch positions rank `rank` needs, each once, in the order it first runs them."""
        return list(dict.fromkeys(p for s in range(self.num_steps) for p in self.split_share(s, rank)[0]))

    def rank_steps(self, rank: int) -> list[list[int]]:
        """For every step, the indices into `rank_positions(rank)` of the samples the rank runs in it (its
        split samples first)."""
        index = {p: i for i, p in enumerate(self.rank_positions(rank))}
        return [[index[p] for p in self.split_share(s, rank)[0]] for s in range(self.num_steps)]


def plan_steps(
    seqlens: Sequence[int],
    stock: Steps,
    *,
    max_token_len: int | None,
    micro_batch_size: int | None = None,
    cost: str | CostModel = "tokens",
    rank_speed: Sequence[float] | None = None,
    micro_batch_cost: float = 0.0,
    min_gain: float = MIN_GAIN,
    ulysses: UlyssesModel | None = None,
    throughput: float | None = 1.0,
) -> StepPlan:
    """Split the samples of each of verl's steps (`stock`, as `verl_steps` gives them) over its ranks with
    LB-Mini; verl's own pieces are the baseline LB-Mini keeps unless its split is predicted at least
    `min_gain` faster.

    With dynamic batch sizes `max_token_len` is the per-micro-batch token budget (a sample longer than it
    is an error, as in verl); with a fixed micro-batch size pass `max_token_len=None, micro_batch_size=n`.
    `rank_speed` and `micro_batch_cost` go to LB-Mini (the `auto` cost's fit). With `ulysses` a step's
    longest samples may be split over groups of ranks (odc_plugin.balance.split.lb_mini_split, LB-Mini's
    plan as the one to beat); `throughput` (cost units per second: 1 for a cost in seconds) puts their
    all-to-alls in the cost's units and the predictions in seconds. None: not known yet (a static cost the
    engine has not timed), so the all-to-alls are left out and the predictions stay in the cost's units.

    Long because it checks verl's constraints one by one, each with its own message, before planning.
    """
    lens = [int(s) for s in seqlens]
    if not stock or not stock[0]:
        raise ValueError("cannot plan a call without steps or ranks")
    dp_size = len(stock[0])
    if micro_batch_size is None:
        if max_token_len is None:
            raise ValueError("give max_token_len (dynamic batch size) or micro_batch_size (fixed micro-batch size)")
        _check_int("max_token_len", max_token_len)
        too_long = [p for p, s in enumerate(lens) if s > max_token_len]
        if too_long:
            raise ValueError(
                f"sample {too_long[0]} has {lens[too_long[0]]} tokens, more than the per-micro-batch budget "
                f"max_token_len={max_token_len} (ppo_max_token_len_per_gpu must hold the longest sequence)"
            )
    else:
        _check_int("micro_batch_size", micro_batch_size)
    cost_model = get_cost_model(cost)
    if ulysses is not None and throughput is None:
        ulysses = replace(ulysses, bytes_per_token=0.0, all_to_alls=0)
    per_second = throughput or 1.0  # the all-to-alls left out where it is not known
    steps, micro, splits, predicted = [], [], [], []
    for stock_step in stock:
        if len(stock_step) != dp_size or any(not piece for piece in stock_step):
            raise ValueError(
                f"a step of {sum(map(len, stock_step))} samples leaves one of {dp_size} data-parallel ranks "
                f"without a sample; raise ppo_mini_batch_size * rollout.n to at least {dp_size}"
            )
        members = [p for piece in stock_step for p in piece]
        step_lens = [lens[p] for p in members]
        budget = max_token_len if micro_batch_size is None else max(max(step_lens), 1)
        baseline, start = [], 0
        for piece in stock_step:
            baseline.append([list(range(start, start + len(piece)))])
            start += len(piece)
        ranks = lb_mini(
            step_lens,
            dp_size,
            budget,
            cost=cost_model,
            rank_speed=rank_speed,
            micro_batch_cost=micro_batch_cost,
            baseline=baseline,
            min_gain=min_gain,
            micro_batch_size=micro_batch_size,
        )
        split = ()
        if ulysses is not None:
            planned = lb_mini_split(
                step_lens,
                dp_size,
                budget,
                cost_model,
                ulysses=ulysses,
                rank_speed=rank_speed,
                throughput=per_second,
                micro_batch_size=micro_batch_size,
                baseline=ranks,
                min_gain=min_gain,
            )
            ranks, split = planned.ranks, planned.splits
            predicted.append((planned.seconds / per_second, planned.unsplit_seconds / per_second))
        # in verl's order within the step: a kept baseline is then verl's own piece, sample for sample
        shares = [sorted(i for mb in rank for i in mb) for rank in ranks]
        in_groups = [sum(r in s.group for s in split) for r in range(dp_size)]
        _fill_empty_ranks(shares, cost_model.costs(step_lens), busy=[n > 0 for n in in_groups])
        steps.append(tuple(tuple(members[i] for i in share) for share in shares))
        splits.append(tuple(Split(members[s.sample], s.k, s.first) for s in split))
        if micro_batch_size is None:
            packed = [len(verl_micro_batches([step_lens[i] for i in s], budget)) if s else 0 for s in shares]
        else:
            packed = [-(-len(s) // micro_batch_size) for s in shares]
        micro.append(tuple(n + k for n, k in zip(packed, in_groups)))
    return StepPlan(
        steps=tuple(steps),
        micro_batches=tuple(micro),
        splits=tuple(splits) if ulysses is not None else (),
        predicted=tuple(predicted),
        predicted_in_seconds=throughput is not None,
    )


def _fill_empty_ranks(shares: list[list[int]], costs: Sequence[float], busy: Sequence[bool] = ()) -> None:
    """Give every empty rank the cheapest sample of the rank holding most samples (in place); a rank that
    runs a split sample (`busy`) has work without a share.

    An empty share would be an empty TensorDict on that rank, which verl's engines cannot train on;
    LB-Mini leaves ranks empty when one sample outweighs many others.
    """
    while True:
        empty = [r for r, share in enumerate(shares) if not share and not (busy and busy[r])]
        if not empty:
            return
        donor = max(range(len(shares)), key=lambda r: (len(shares[r]), -r))
        if len(shares[donor]) < 2:  # callers guarantee at least as many samples as ranks
            raise ValueError("fewer samples than ranks")
        sample = min(shares[donor], key=lambda i: (costs[i], i))
        shares[donor].remove(sample)
        shares[empty[0]].append(sample)


def plan_metrics(plan: StepPlan, seqlens: Sequence[int], cost: str | CostModel, prefix: str) -> dict[str, float]:
    """Balance statistics of a plan, in the spirit of verl's `global_seqlen/*`.

    {prefix}/min, /max, /minmax_diff, /mean: tokens each rank runs over the whole call (all steps);
    {prefix}/efficiency, /efficiency_min: per step, the lower bound on the busiest rank's cost over its
        actual cost (1 = no split could do better), the mean and the worst over steps;
    {prefix}/samples_min, /samples_max: samples of one rank in one step;
    {prefix}/micro_batches_min, /micro_batches_max: predicted micro-batches of one rank in one step;
    {prefix}/mini_batches: optimizer steps of the call;
    with `odc_split`: {prefix}/split_predicted_s and /unsplit_predicted_s, the planner's time of the call's
        steps with its splits and without (`split_predicted_cost` and `unsplit_predicted_cost`, in the
        cost's units, before the engine has timed a static cost), and {prefix}/split_samples, the samples it
        split.
    A split sample counts a k-th of its tokens and cost on each rank of its group of k.
    """
    costs = get_cost_model(cost).costs([int(s) for s in seqlens])

    steps = range(plan.num_steps)
    tokens = [sum(sum(plan.rank_items(s, r, seqlens)) for s in steps) for r in range(plan.dp_size)]
    efficiency = [balance_efficiency([plan.rank_items(s, r, costs) for r in range(plan.dp_size)]) for s in steps]
    counts = [len(share) for step in plan.steps for share in step]
    micro = [m for step in plan.micro_batches for m in step]
    split = {}
    if plan.predicted:
        unit = "s" if plan.predicted_in_seconds else "cost"
        split[f"{prefix}/split_predicted_{unit}"] = sum(p[0] for p in plan.predicted)
        split[f"{prefix}/unsplit_predicted_{unit}"] = sum(p[1] for p in plan.predicted)
        split[f"{prefix}/split_samples"] = float(sum(map(len, plan.splits)))
    return {
        **split,
        f"{prefix}/min": float(min(tokens)),
        f"{prefix}/max": float(max(tokens)),
        f"{prefix}/minmax_diff": float(max(tokens) - min(tokens)),
        f"{prefix}/mean": sum(tokens) / len(tokens),
        f"{prefix}/efficiency": sum(efficiency) / len(efficiency),
        f"{prefix}/efficiency_min": min(efficiency),
        f"{prefix}/samples_min": float(min(counts)),
        f"{prefix}/samples_max": float(max(counts)),
        f"{prefix}/micro_batches_min": float(min(micro)),
        f"{prefix}/micro_batches_max": float(max(micro)),
        f"{prefix}/mini_batches": float(plan.num_steps),
    }


def plan_seconds(plan: StepPlan, seqlens: Sequence[int], fit: TimeFit) -> list[float]:
    """Per step, the fit's time of its slowest rank: what LB-Mini expected the plan to take (with splits, the
    split planner's own time)."""
    if plan.predicted:
        return [split for split, _ in plan.predicted]
    costs = fit.costs([int(s) for s in seqlens])
    return [
        max(
            (sum(costs[p] for p in share) + fit.c * plan.micro_batches[s][r]) / fit.speeds[r]
            for r, share in enumerate(step)
        )
        for s, step in enumerate(plan.steps)
    ]


@dataclass
class LBMiniSettings:
    """What the trainer needs to plan one role's calls: its cost, its micro-batching, its fit."""

    cost: CostModel  # with `auto`: the prior, until the engine has reported a fit
    max_token_len: int | None  # the per-GPU token budget (dynamic batch size), as the role's config gives it
    micro_batch_size: int | None  # the engine's fixed micro-batch size (no dynamic batch size)
    auto: bool = False
    # Ulysses: a sequence-parallel group of this many ranks runs each micro-batch together, and verl packs
    # its micro-batches to the per-GPU budget times this size
    sp_size: int = 1
    ulysses: UlyssesModel | None = None  # with odc_split: the groups a long sample may be split over
    fit: TimeFit | None = None  # the auto cost's latest fit
    # with odc_split and a cost not in seconds (tokens, flops, auto before its fit): cost units per second of
    # the role's last update (its cost over its ranks' compute seconds), which prices the all-to-alls
    measured_throughput: float | None = None
    fit_from: LBMiniSettings | None = None  # a forward-only pass plans with its role's training fit

    @property
    def current_fit(self) -> TimeFit | None:
        return self.fit_from.current_fit if self.fit_from is not None else self.fit

    @property
    def throughput(self) -> float | None:
        """The static cost's units per second: 1 for a cost in seconds (`fit`), else what the role's last
        update measured (None before it). A plan made with the auto fit is in seconds whatever this says."""
        if self.cost.name == "fit":
            return 1.0
        return (self.fit_from or self).measured_throughput

    def plan(self, seqlens: Sequence[int], stock: Steps) -> tuple[StepPlan, TimeFit | None]:
        """The plan of one call, and the fit it was made with (None: the static cost)."""
        fit = self.current_fit
        if fit is not None and len(fit.speeds) != len(stock[0]):
            fit = None  # fitted on another mesh (a forward-only pass on fewer ranks)
        plan = plan_steps(
            seqlens,
            stock,
            max_token_len=self.max_token_len * self.sp_size if self.max_token_len else None,
            micro_batch_size=self.micro_batch_size,
            cost=fit or self.cost,
            rank_speed=fit.speeds if fit else None,
            micro_batch_cost=fit.c if fit else 0.0,
            min_gain=fit.min_gain if fit else MIN_GAIN,
            ulysses=self.ulysses,
            throughput=1.0 if fit else self.throughput,
        )
        return plan, fit

    def for_inference(
        self, max_token_len: int | None, micro_batch_size: int | None, ulysses: UlyssesModel | None = None
    ) -> LBMiniSettings:
        """A forward-only pass of the same role, planned with this fit; its samples split as `ulysses` allows
        (the pass's own engine's odc_split)."""
        return LBMiniSettings(
            self.cost, max_token_len, micro_batch_size, self.auto, self.sp_size, ulysses=ulysses, fit_from=self
        )

    def observe(self, metrics: dict, prefix: str, plan: StepPlan, seqlens: Sequence[int]) -> dict[str, float]:
        """Take what the role's engine measured in the update `plan` (of samples of `seqlens` tokens) from its
        metrics (the prefix is `actor/` or `critic/` in the PPO trainer, empty in the SFT trainers): the auto
        fit (`<prefix>odc/fit_*`, `<prefix>odc/rank_speed_<r>`) and, where a split's all-to-alls need it, the
        cost's throughput (the plan's cost over the ranks' compute seconds, `<prefix>odc/compute_s_mean` a
        mini-batch). Returns them as `odc_balance` metrics (empty where there is neither)."""
        observed = {}
        compute_s = metrics.get(f"{prefix}odc/compute_s_mean")
        if self.ulysses is not None and self.cost.name != "fit" and compute_s:
            costs = self.cost.costs([int(s) for s in seqlens])
            work = sum(sum(plan.rank_items(s, r, costs)) for s in range(plan.num_steps) for r in range(plan.dp_size))
            self.measured_throughput = work / (float(compute_s) * plan.dp_size * plan.num_steps)
            observed["cost_per_s"] = self.measured_throughput
        if not self.auto or f"{prefix}odc/fit_c" not in metrics:
            return observed
        speeds = []
        while f"{prefix}odc/rank_speed_{len(speeds)}" in metrics:
            speeds.append(float(metrics[f"{prefix}odc/rank_speed_{len(speeds)}"]))
        self.fit = TimeFit(
            a=float(metrics[f"{prefix}odc/fit_a"]),
            b=float(metrics[f"{prefix}odc/fit_b"]),
            c=float(metrics[f"{prefix}odc/fit_c"]),
            speeds=tuple(speeds),
            timings=int(metrics[f"{prefix}odc/fit_timings"]),
            error=float(metrics.get(f"{prefix}odc/fit_error", 0.0)),
        )
        return {
            **observed,
            "fit_c": self.fit.c,
            "fit_a": self.fit.a,
            "fit_b": self.fit.b,
            "fit_error": self.fit.error,
            "rank_speed_min": min(speeds),
            "rank_speed_max": max(speeds),
        }


@dataclass
class PlanRequest:
    """What the trainer attaches to the batch of one call (extra_info[PLAN_KEY]): the role's settings and
    whether the call is an update. The dispatch (in the trainer's process) plans with it and leaves the
    plan here, for the trainer's metrics."""

    settings: LBMiniSettings
    update: bool
    plan: StepPlan | None = None
    seqlens: list[int] = field(default_factory=list)
    fit: TimeFit | None = None  # the fit the plan was made with
    plan_s: float = 0.0  # seconds spent finding verl's steps and planning them
    dispatch_s: float = 0.0  # seconds spent splitting the batch by the plan and handing it to verl's dispatch


def split_by_plan(meta, dp_size: int) -> list:
    """One piece of the KVBatchMeta `meta` per data-parallel rank, planned with the PlanRequest in its
    extra_info: the rank's samples (each once, in the order it first runs them) and the batch's
    extra_info without the request, plus STEPS_KEY (per step, the indices of the samples it runs)."""
    extra = dict(meta.extra_info or {})
    request: PlanRequest = extra.pop(PLAN_KEY)
    start = time.perf_counter()
    request.seqlens = [int(tag["seq_len"]) for tag in meta.tags]
    request.plan, request.fit = request.settings.plan(request.seqlens, verl_steps(meta, dp_size, request.update))
    request.plan_s = time.perf_counter() - start
    plan = request.plan
    pieces = []
    for rank in range(dp_size):
        positions = plan.rank_positions(rank)
        steps = {STEPS_KEY: plan.rank_steps(rank)}
        if any(plan.splits):
            steps[SPLIT_STEPS_KEY] = [plan.split_share(s, rank)[1] for s in range(plan.num_steps)]
        pieces.append(
            type(meta)(
                keys=[meta.keys[p] for p in positions],
                tags=[meta.tags[p] for p in positions],
                partition_id=meta.partition_id,
                fields=meta.fields,
                extra_info={**extra, **steps},
            )
        )
    return pieces


def collect_once(outputs: list) -> list:
    """The ranks' outputs of a forward-only call (KVBatchMeta, in rank order) with each sample once: every
    member of a split sample's group wrote the same gathered outputs under its key, and verl's collect
    refuses a key twice. Anything else (an update's metrics, a non-blocking call's futures) as it is."""
    if not outputs or not all(hasattr(o, "select_keys") for o in outputs):
        return outputs
    seen, once = set(), []
    for output in outputs:
        keys = [k for k in output.keys if k not in seen]
        seen.update(keys)
        once.append(output if len(keys) == len(output.keys) else output.select_keys(keys))
    return once


@dataclass(frozen=True)
class TrainPacking:
    """How verl's engine of a role cuts its training mini-batches into micro-batches: the settings it is
    built with, which are not always the role's keys of the same name."""

    use_dynamic_bsz: bool
    max_token_len: int | None
    micro_batch_size: int | None


def actor_packing(actor) -> TrainPacking:
    """The actor's (an FSDPActorConfig): what ActorRolloutRefWorker.init_model gives its engine
    (engine_workers.py:619-628)."""
    return TrainPacking(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, actor.ppo_micro_batch_size_per_gpu)


def critic_packing(critic) -> TrainPacking:
    """The critic's (a CriticConfig): what PPOTrainer._setup gives its engine (v1/trainer_base.py:266-268).
    verl 0.9.1 builds it from the engine config alone, whose use_dynamic_bsz defaults to True, with the
    critic's inference token budget; `critic.use_dynamic_bsz` and `ppo_micro_batch_size_per_gpu` do not reach it."""
    engine = critic.engine
    return TrainPacking(engine.use_dynamic_bsz, critic.ppo_infer_max_token_len_per_gpu, engine.micro_batch_size_per_gpu)


def packs_as_fsdp2(engine_config, use_dynamic_bsz: bool) -> bool:
    """Whether an odc role packs every rank's micro-batches as fsdp2 does: verl's equal split (`lb_micro`),
    cut into fixed-size micro-batches, or with dynamic batch sizes as many as the busiest rank's (lockstep)."""
    from odc_plugin.verl.config import as_odc_config

    odc = as_odc_config(engine_config)
    return odc.odc_balancer == "lb_micro" and (odc.odc_lockstep or not use_dynamic_bsz)


def sequence_parallel_size(engine_config) -> int:
    return int(getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1)


def lb_mini_settings(
    engine_config,
    *,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    micro_batch_size: int | None,
    model_config: Any | Callable[[], Any] = None,
    gpus_per_node: int | None = None,
) -> LBMiniSettings | None:
    """LB-Mini settings of a role, or None when its calls keep verl's equal split.

    A role uses LB-Mini when its engine config's strategy is `odc` and its `odc_balancer` is `lb_mini`
    (a plain FSDPEngineConfig carrying strategy odc gets ODC's defaults, see `as_odc_config`). The cost
    model comes from `odc_cost_model`; "flops" reads the model's HF config: `model_config` is that config
    (a transformers PretrainedConfig or a dict) or a function returning it, called only when needed;
    "auto" starts from "flops" and follows the fit the engine reports (`LBMiniSettings.observe`).
    With `odc_split=auto` and `gpus_per_node` the plan may split samples over groups of ranks inside a node.
    """
    if getattr(engine_config, "strategy", None) != "odc":
        return None
    from odc_plugin.verl.config import as_odc_config

    odc = as_odc_config(engine_config)
    if odc.odc_balancer != "lb_mini":
        return None
    auto = odc.odc_cost_model == "auto"
    if odc.odc_cost_model in ("flops", "auto"):
        if model_config is None:
            raise ValueError(f"odc_cost_model={odc.odc_cost_model} needs the model's config")
        cost = get_cost_model("flops", model=model_config() if callable(model_config) else model_config)
    elif odc.odc_cost_model == "fit":
        cost = get_cost_model("fit", a=odc.odc_cost_fit_a, b=odc.odc_cost_fit_b)
    else:
        cost = get_cost_model(odc.odc_cost_model)
    sp_size = sequence_parallel_size(engine_config)
    ulysses = None
    if odc.odc_split == "auto" and gpus_per_node:
        ulysses = UlyssesModel.from_config(
            model_config() if callable(model_config) else model_config,
            gpus_per_node,
            bandwidth=odc.odc_split_bandwidth,
            latency_s=odc.odc_split_latency_s,
        )
    if use_dynamic_bsz:
        if max_token_len is None:
            raise ValueError("use_dynamic_bsz needs ppo_max_token_len_per_gpu")
        return LBMiniSettings(cost, int(max_token_len), None, auto, sp_size=sp_size, ulysses=ulysses)
    if micro_batch_size is None:
        raise ValueError("without use_dynamic_bsz the engine needs ppo_micro_batch_size_per_gpu")
    return LBMiniSettings(cost, None, int(micro_batch_size), auto, sp_size=sp_size, ulysses=ulysses)


def _check_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
