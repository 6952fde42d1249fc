"""LB-Mini dispatch: how one rollout batch becomes every rank's share of every mini-batch.

verl's v1 trainer gives each data-parallel rank the same number of samples and each rank cuts its share
into `mini_batch_size // dp` pieces, one per optimizer step. With `strategy=odc` ranks only meet at the
end of a mini-batch, so a mini-batch can be split by work instead of by count:

1. mini-batch membership is decided first, as consecutive slices of the batch in the order the trainer
   received it (verl pads that batch to a multiple of the mini-batch size);
2. each mini-batch is split over ranks with LB-Mini (`odc_plugin.balance.lb_mini`); counts may differ,
   but every rank gets at least one sample of every mini-batch;
3. each rank receives its samples rank-major (its share of mini-batch 0, then of mini-batch 1, ...)
   together with its count per mini-batch, and runs one optimizer step per mini-batch.

This module is the pure part (plans, the split of a batch's metadata, the metrics, the step order); the
verl patches that use it are `patches/lb_mini_dispatch.py` (trainer and dispatch) and
`patches/lb_mini_worker.py` (`TrainingWorker.train_mini_batch`).
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from odc_plugin.balance import CostModel, balance_efficiency, get_cost_model, lb_mini, verl_rank_partition
from odc_plugin.balance.lb_mini import MIN_GAIN
from odc_plugin.balance.online_fit import TimeFit

# extra_info entry the trainer sets on the batch of one update call; only the dispatch reads it.
PLAN_KEY = "odc_lb_mini_plan"
# extra_info entry each rank receives instead: its number of samples in each mini-batch, in order.
COUNTS_KEY = "odc_mini_batch_counts"


@dataclass(frozen=True)
class MiniBatchPlan:
    """Where every sample of a batch goes.

    order: batch positions, rank-major: rank 0's samples of mini-batch 0, then of mini-batch 1, ...,
        then rank 1's; within one rank and mini-batch in batch order.
    counts: counts[r][i] = samples of mini-batch i on rank r (every entry >= 1).
    micro_batches: micro_batches[r][i] = micro-batches LB-Mini's packing predicts for that share under
        the token budget (or the fixed micro-batch size); the engine packs its own, so this is an estimate.
    """

    mini_batch_size: int
    order: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]
    micro_batches: tuple[tuple[int, ...], ...]

    @property
    def dp_size(self) -> int:
        return len(self.counts)

    @property
    def num_mini_batches(self) -> int:
        return len(self.counts[0])

    def rank_positions(self, rank: int) -> list[int]:
        """Batch positions of one rank, in the order it receives them."""
        start = sum(sum(c) for c in self.counts[:rank])
        return list(self.order[start : start + sum(self.counts[rank])])

    def shares(self) -> list[list[list[int]]]:
        """shares[i][r]: batch positions of mini-batch i on rank r."""
        out = [[[] for _ in range(self.dp_size)] for _ in range(self.num_mini_batches)]
        for r in range(self.dp_size):
            positions = iter(self.rank_positions(r))
            for i, n in enumerate(self.counts[r]):
                out[i][r] = [next(positions) for _ in range(n)]
        return out


def plan_mini_batches(
    seqlens: Sequence[int],
    mini_batch_size: int,
    dp_size: int,
    max_token_len: int | None,
    cost: str | CostModel = "tokens",
    *,
    micro_batch_size: int | None = None,
    group_ids: Sequence[Hashable] | None = None,
    rank_speed: Sequence[float] | None = None,
    micro_batch_cost: float = 0.0,
    min_gain: float = MIN_GAIN,
) -> MiniBatchPlan:
    """Split every mini-batch of a batch over `dp_size` ranks with LB-Mini.

    Mini-batch i is positions [i * mini_batch_size, (i + 1) * mini_batch_size) of the batch. With dynamic
    batch sizes `max_token_len` is the per-micro-batch token budget (a sample longer than it is an error,
    as in verl); with a fixed micro-batch size pass `max_token_len=None, micro_batch_size=n`. `group_ids`
    keeps samples of one group on one rank (verl 0.9.1 does not need it: GRPO advantages are computed on
    the driver), except where that would leave a rank empty. `rank_speed` and `micro_batch_cost` go to
    LB-Mini (the `auto` cost's fit), and so does `min_gain`, the smallest predicted gain for which LB-Mini
    leaves verl's equal split (see lb_mini).

    Long because it checks verl's constraints one by one, each with its own message, before planning.
    """
    lens = [int(s) for s in seqlens]
    _check_int("mini_batch_size", mini_batch_size)
    _check_int("dp_size", dp_size)
    if not lens:
        raise ValueError("cannot plan an empty batch")
    if len(lens) % mini_batch_size:
        raise ValueError(
            f"{len(lens)} samples do not make whole mini-batches of {mini_batch_size}; verl pads the batch to a "
            f"multiple of the mini-batch size, so the batch reaching the plan must be one"
        )
    if mini_batch_size < dp_size:
        raise ValueError(
            f"a mini-batch of {mini_batch_size} samples cannot give each of {dp_size} data-parallel ranks a sample; "
            f"raise ppo_mini_batch_size * rollout.n to at least {dp_size}"
        )
    if group_ids is not None and len(group_ids) != len(lens):
        raise ValueError(f"group_ids has {len(group_ids)} entries for {len(lens)} samples")
    if micro_batch_size is None:
        if max_token_len is None:
            raise ValueError("give max_token_len (dynamic batch size) or micro_batch_size (fixed micro-batch size)")
        _check_int("max_token_len", max_token_len)
        budget = max_token_len
        too_long = [i for i, s in enumerate(lens) if s > budget]
        if too_long:
            raise ValueError(
                f"sample {too_long[0]} has {lens[too_long[0]]} tokens, more than the per-micro-batch budget "
                f"max_token_len={budget} (ppo_max_token_len_per_gpu must hold the longest sequence)"
            )
    else:
        _check_int("micro_batch_size", micro_batch_size)
        budget = max(max(lens), 1)  # packing is by count then; no sample may fail the budget
    cost_model = get_cost_model(cost)
    costs = cost_model.costs(lens)

    order: list[list[int]] = [[] for _ in range(dp_size)]
    counts: list[list[int]] = [[] for _ in range(dp_size)]
    micro: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, len(lens), mini_batch_size):
        local_lens = lens[start : start + mini_batch_size]
        local_groups = None if group_ids is None else list(group_ids[start : start + mini_batch_size])
        # verl's own equal-count split of this mini-batch (LB-Micro) stays unless LB-Mini predicts a real gain
        equal = (
            [[share] for share in verl_rank_partition(local_lens, dp_size)]
            if local_groups is None and mini_batch_size % dp_size == 0
            else None
        )
        ranks = lb_mini(
            local_lens,
            dp_size,
            budget,
            cost=cost_model,
            group_ids=local_groups,
            rank_speed=rank_speed,
            micro_batch_cost=micro_batch_cost,
            baseline=equal,
            min_gain=min_gain,
        )
        shares = [sorted(i for mb in rank for i in mb) for rank in ranks]
        _fill_empty_ranks(shares, costs[start : start + mini_batch_size])
        for r, share in enumerate(shares):
            order[r].extend(start + i for i in share)
            counts[r].append(len(share))
            if micro_batch_size is None:
                micro[r].append(len(lb_mini([local_lens[i] for i in share], 1, budget, cost=cost_model)[0]))
            else:
                micro[r].append(math.ceil(len(share) / micro_batch_size))
    return MiniBatchPlan(
        mini_batch_size=mini_batch_size,
        order=tuple(p for rank in order for p in rank),
        counts=tuple(tuple(c) for c in counts),
        micro_batches=tuple(tuple(m) for m in micro),
    )


def _fill_empty_ranks(shares: list[list[int]], costs: Sequence[float]) -> None:
    """Give every empty rank the cheapest sample of the rank holding most samples (in place).

    An empty share would be an empty TensorDict on that rank, which verl's engines cannot train on;
    LB-Mini leaves ranks empty when one sample outweighs many others.
    """
    while True:
        empty = [r for r, share in enumerate(shares) if not share]
        if not empty:
            return
        donor = max(range(len(shares)), key=lambda r: (len(shares[r]), -r))
        if len(shares[donor]) < 2:  # callers guarantee at least as many samples as ranks
            raise ValueError("fewer samples than ranks")
        sample = min(shares[donor], key=lambda i: (costs[i], i))
        shares[donor].remove(sample)
        shares[empty[0]].append(sample)


def plan_payload(plan: MiniBatchPlan, keys: Sequence[str]) -> dict[str, Any]:
    """The plan as the dispatch needs it, by sample key (`keys[p]` is the key at batch position p)."""
    if len(keys) != len(plan.order):
        raise ValueError(f"plan covers {len(plan.order)} samples, the batch has {len(keys)}")
    return {
        "mini_batch_size": plan.mini_batch_size,
        "keys": [[keys[p] for p in plan.rank_positions(r)] for r in range(plan.dp_size)],
        "counts": [list(c) for c in plan.counts],
    }


def split_by_plan(meta, dp_size: int) -> list:
    """One piece of a KVBatchMeta per data-parallel rank, as the batch's plan (extra_info[PLAN_KEY]) says.

    Each piece holds that rank's samples rank-major and the batch's extra_info without the plan, plus
    COUNTS_KEY: the rank's sample count per mini-batch. Raises if the plan does not cover the batch
    exactly or disagrees with the mini-batch size the trainer set for this update.
    """
    extra = dict(meta.extra_info or {})
    payload = extra.pop(PLAN_KEY)
    rank_keys, counts = payload["keys"], payload["counts"]
    if len(rank_keys) != dp_size or len(counts) != dp_size:
        raise ValueError(f"the LB-Mini plan is for {len(rank_keys)} ranks, the worker group has {dp_size}")
    flat = [k for keys in rank_keys for k in keys]
    if len(flat) != len(meta.keys) or set(flat) != set(meta.keys):
        raise ValueError(
            f"the LB-Mini plan covers {len(flat)} samples that are not the batch's {len(meta.keys)}: "
            f"the batch changed between _balance_batch and the update"
        )
    num_mini = {len(c) for c in counts}
    if len(num_mini) != 1:
        raise ValueError(f"ranks would run different numbers of mini-batches: {sorted(num_mini)}")
    mini_batch_size = payload["mini_batch_size"]
    if extra.get("mini_batch_size", mini_batch_size) != mini_batch_size:
        raise ValueError(
            f"the LB-Mini plan was made for mini-batches of {mini_batch_size} samples, the update asks for "
            f"{extra['mini_batch_size']}"
        )
    for i in range(num_mini.pop()):
        if sum(c[i] for c in counts) != mini_batch_size:
            raise ValueError(f"mini-batch {i} of the LB-Mini plan does not hold {mini_batch_size} samples")
    for r, (keys, c) in enumerate(zip(rank_keys, counts)):
        if sum(c) != len(keys) or min(c) < 1:
            raise ValueError(f"rank {r}: counts {c} do not fit its {len(keys)} samples or leave a mini-batch empty")

    tag_of = dict(zip(meta.keys, meta.tags))
    return [
        type(meta)(
            keys=list(keys),
            tags=[tag_of[k] for k in keys],
            partition_id=meta.partition_id,
            fields=meta.fields,
            extra_info={**extra, COUNTS_KEY: list(c)},
        )
        for keys, c in zip(rank_keys, counts)
    ]


def plan_metrics(plan: MiniBatchPlan, seqlens: Sequence[int], cost: str | CostModel, prefix: str) -> dict[str, float]:
    """Balance statistics of a plan, in the spirit of verl's `global_seqlen/*`.

    {prefix}/min, /max, /minmax_diff, /mean: tokens per rank over the whole batch (all mini-batches);
    {prefix}/efficiency, /efficiency_min: per mini-batch, the lower bound on the busiest rank's cost over
        its actual cost (1 = no split could do better), the mean and the worst over mini-batches;
    {prefix}/samples_min, /samples_max: samples of one rank in one mini-batch;
    {prefix}/micro_batches_min, /micro_batches_max: predicted micro-batches of one rank in one mini-batch;
    {prefix}/mini_batches: optimizer steps per update.
    """
    costs = get_cost_model(cost).costs([int(s) for s in seqlens])
    tokens = [sum(seqlens[p] for p in plan.rank_positions(r)) for r in range(plan.dp_size)]
    efficiency = [balance_efficiency([[costs[p] for p in share] for share in mb]) for mb in plan.shares()]
    counts = [c for rank in plan.counts for c in rank]
    micro = [m for rank in plan.micro_batches for m in rank]
    return {
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
        f"{prefix}/mini_batches": float(plan.num_mini_batches),
    }


@dataclass
class LBMiniSettings:
    """What the trainer needs to plan one role's passes: the updates' mini-batches, or a forward-only pass
    (`mini_batch_size` None: the whole batch is one mini-batch, split over ranks as one)."""

    mini_batch_size: int | None
    cost: CostModel  # with `auto`: the prior, until the engine has reported a fit
    max_token_len: int | None  # the per-GPU token budget (dynamic batch size), as the role's config gives it
    micro_batch_size: int | None  # the engine's fixed micro-batch size (no dynamic batch size)
    auto: bool = False
    # Ulysses: a sequence-parallel group of this many ranks runs each micro-batch together, and verl packs
    # its micro-batches to the per-GPU budget times this size
    sp_size: int = 1
    fit: TimeFit | None = None  # the auto cost's latest fit
    fit_from: LBMiniSettings | None = None  # a forward-only pass plans with its role's training fit

    @property
    def current_fit(self) -> TimeFit | None:
        return self.fit_from.current_fit if self.fit_from is not None else self.fit

    def plan(self, seqlens: Sequence[int], dp_size: int) -> MiniBatchPlan:
        fit = self.current_fit
        if fit is not None and len(fit.speeds) != dp_size:
            fit = None  # fitted on another mesh (a forward-only pass on fewer ranks)
        return plan_mini_batches(
            seqlens,
            self.mini_batch_size or len(seqlens),
            dp_size,
            self.max_token_len * self.sp_size if self.max_token_len else None,
            fit or self.cost,
            micro_batch_size=self.micro_batch_size,
            rank_speed=fit.speeds if fit else None,
            micro_batch_cost=fit.c if fit else 0.0,
            min_gain=fit.min_gain if fit else MIN_GAIN,
        )

    def for_inference(self, max_token_len: int | None, micro_batch_size: int | None) -> LBMiniSettings:
        """A forward-only pass of the same role: the whole batch at once, planned with this fit."""
        return LBMiniSettings(
            None, self.cost, max_token_len, micro_batch_size, self.auto, fit_from=self, sp_size=self.sp_size
        )

    def observe(self, metrics: dict, role: str) -> dict[str, float]:
        """Take the auto fit the role's engine reported in the update's metrics (`<role>/odc/fit_*`,
        `<role>/odc/rank_speed_<r>`); returns it as `odc_balance` metrics (empty without a fit)."""
        if not self.auto or f"{role}/odc/fit_c" not in metrics:
            return {}
        speeds = []
        while f"{role}/odc/rank_speed_{len(speeds)}" in metrics:
            speeds.append(float(metrics[f"{role}/odc/rank_speed_{len(speeds)}"]))
        self.fit = TimeFit(
            a=float(metrics[f"{role}/odc/fit_a"]),
            b=float(metrics[f"{role}/odc/fit_b"]),
            c=float(metrics[f"{role}/odc/fit_c"]),
            speeds=tuple(speeds),
            timings=int(metrics[f"{role}/odc/fit_timings"]),
            error=float(metrics.get(f"{role}/odc/fit_error", 0.0)),
        )
        return {
            "fit_c": self.fit.c,
            "fit_a": self.fit.a,
            "fit_b": self.fit.b,
            "fit_error": self.fit.error,
            "rank_speed_min": min(speeds),
            "rank_speed_max": max(speeds),
        }


def plan_seconds(plan: MiniBatchPlan, seqlens: Sequence[int], fit: TimeFit) -> list[float]:
    """Per mini-batch, the fit's time of its slowest rank: what LB-Mini expected the plan to take."""
    costs = fit.costs([int(s) for s in seqlens])
    return [
        max(
            (sum(costs[p] for p in share) + fit.c * plan.micro_batches[r][i]) / fit.speeds[r]
            for r, share in enumerate(mini_batch)
        )
        for i, mini_batch in enumerate(plan.shares())
    ]


def lb_mini_settings(
    engine_config,
    *,
    mini_batch_size: int,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    micro_batch_size: int | None,
    model_config: Any | Callable[[], Any] = None,
) -> LBMiniSettings | None:
    """LB-Mini settings of a role, or None when its updates keep verl's equal split.

    A role uses LB-Mini when its engine config's strategy is `odc` and its `odc_balancer` is `lb_mini`
    (a plain FSDPEngineConfig carrying strategy odc gets ODC's defaults, see `as_odc_config`). The cost
    model comes from `odc_cost_model`; "flops" reads the model's HF config: `model_config` is that config
    (a transformers PretrainedConfig or a dict) or a function returning it, called only when needed;
    "auto" starts from "flops" and follows the fit the engine reports (`LBMiniSettings.observe`).
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
    sp_size = int(getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1)
    if use_dynamic_bsz:
        if max_token_len is None:
            raise ValueError("use_dynamic_bsz needs ppo_max_token_len_per_gpu")
        return LBMiniSettings(int(mini_batch_size), cost, int(max_token_len), None, auto, sp_size=sp_size)
    if micro_batch_size is None:
        raise ValueError("without use_dynamic_bsz the engine needs ppo_micro_batch_size_per_gpu")
    return LBMiniSettings(int(mini_batch_size), cost, None, int(micro_batch_size), auto, sp_size=sp_size)


def mini_batch_schedule(num_mini_batches: int, epochs: int, seed: int, shuffle: bool) -> list[int]:
    """The mini-batches one update runs, in order: every mini-batch once per epoch.

    With shuffle the order of the mini-batches changes from epoch to epoch (the same order on every
    rank, since all ranks must step through the same global mini-batch); which samples form a
    mini-batch never changes, unlike verl's per-rank shuffle, which would break the plan's balance.
    """
    _check_int("epochs", epochs)
    steps = []
    for epoch in range(epochs):
        ids = list(range(num_mini_batches))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(ids)
        steps.extend(ids)
    return steps


def _check_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
