"""verl's SPMD SFT trainer under odc (`torchrun -m verl.trainer.sft_trainer ... engine.strategy=odc`).

verl's `SFTTrainer` gets the choice of its class as its PPO trainers do (`patches/trainer_choice.py`): a
configuration whose `engine.strategy` is `odc` (or whose engine config group is the plugin's `odc`) gets
the subclass built here; any other gets verl's own class. The subclass

- builds the engine config as an `ODCEngineConfig` whichever way odc was named (`engine.strategy=odc` alone
  takes ODC's defaults; verl's FSDP engine config would refuse the strategy);
- under `odc_balancer=lb_mini`, splits each step's global batch (every rank's batch from verl's own loader,
  whose lengths verl's trainer already all-gathers) over the data-parallel ranks with LB-Mini: the same plan
  as `main_ppo`'s dispatch (`dispatch.plan_steps`: verl's split unless LB-Mini's is predicted faster, with
  the engine's `auto` fit of each rank's speed), global rank 0's plan broadcast to every rank. A rank keeps
  its own samples that the plan leaves it and receives the others from their ranks (one all-gather of the
  moved samples alone, none when nothing moves), then trains its share in as many micro-batches as it
  needs. verl's SFT loss divides by the global token count, summed over ranks by the engine, so the split
  changes no gradient;
- logs ODC's metrics as one number per key (`odc/*`) and the plan's balance (`odc_balance/*`).

The loaders, validation and checkpoints are verl's, so a checkpoint saved under one strategy resumes under
the other.
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np

from .config import config_value

# verl's SFT trainer modules, and what odc changes in their trainers (`trainer_class`)
SPMD_MODULE = "verl.trainer.sft_trainer"
ODC_ENGINE_CONFIG = "odc_plugin.verl.config.ODCEngineConfig"
FSDP_ENGINE_CONFIG = "verl.workers.config.FSDPEngineConfig"
WRONG_KEY = (
    "odc: model_engine is main_ppo's key; verl's SFT trainer picks its engine with engine.strategy=odc (ODC's "
    "defaults) or hydra.searchpath=[pkg://odc_plugin.configs] engine=odc (its options as engine.odc_*)"
)


def module_of(cls: type) -> str:
    """The module that defines `cls` by its import name, also when it runs as the script (`torchrun -m`)."""
    if cls.__module__ == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        return spec.name if spec is not None else "__main__"
    return cls.__module__


def wants_odc(config) -> bool:
    """An SFT configuration naming odc: its engine's strategy, or the plugin's engine config group."""
    return (
        config_value(config, "engine.strategy") == "odc" or config_value(config, "engine._target_") == ODC_ENGINE_CONFIG
    )


def trainer_class(cls: type, config) -> type:
    """verl's SFT trainer class `cls` for a configuration without odc; its odc subclass with it."""
    if config_value(config, "model_engine") == "odc":
        raise ValueError(WRONG_KEY)
    if not wants_odc(config):
        return cls
    import odc_patches

    odc_patches.require_odc_verl()
    if module_of(cls) != SPMD_MODULE:
        raise ValueError(
            f"odc: {module_of(cls)}.{cls.__qualname__} is not supported with engine.strategy=odc; run verl's SPMD SFT "
            f"trainer (torchrun -m {SPMD_MODULE})"
        )
    return _subclass(cls)


@functools.cache
def _subclass(cls: type) -> type:
    return type(f"ODC{cls.__name__}", (_ODCSFT, cls), {"__module__": __name__})


def _as_odc_engine_config(config) -> None:
    """`engine.strategy=odc` on verl's FSDP engine config: build ODC's config from the same keys instead."""
    from omegaconf import open_dict

    engine = config.engine
    if engine.get("_target_") == FSDP_ENGINE_CONFIG:
        with open_dict(engine):
            engine["_target_"] = ODC_ENGINE_CONFIG


class _ODCSFT:
    """The odc subclass's members; `_plan` is None when each rank keeps verl's share (lb_micro)."""

    _odc_trainer = True

    def _build_config(self):
        _as_odc_engine_config(self.config)
        super()._build_config()
        from .dispatch import lb_mini_settings

        data = self.config.data
        self._lb_mini = lb_mini_settings(
            self.engine_config,
            use_dynamic_bsz=data.use_dynamic_bsz,
            max_token_len=data.max_token_len_per_gpu,
            micro_batch_size=data.micro_batch_size_per_gpu,
            model_config=lambda: self.model_config.hf_config,
        )
        self._plan = None

    def _build_engine(self):
        super()._build_engine()
        self.training_client = _PlannedClient(self.training_client, self)

    def _get_batch_seqlens(self, data):
        """verl's: the step's lengths over all ranks, rank by rank (its one all-gather); under LB-Mini also
        this step's plan over them."""
        lengths = super()._get_batch_seqlens(data)
        if self._lb_mini is not None:
            start = time.perf_counter()
            self._lengths, self._plan = lengths, self._plan_step(lengths, self.engine.get_data_parallel_size())
            self._balance_s = {"odc_balance/plan_s": time.perf_counter() - start}
        return lengths

    def _plan_step(self, lengths: list[int], dp: int):
        """Global rank 0's LB-Mini plan of one step, on every rank (the Ulysses groups' ranks alike)."""
        import torch.distributed as dist

        plan = [None]
        if dist.get_rank() == 0:
            fit = getattr(self.engine, "odc_time_fit", None)
            self._lb_mini.fit = fit.fit if fit is not None else None
            each = len(lengths) // dp
            plan[0] = self._lb_mini.plan(lengths, [[list(range(r * each, (r + 1) * each)) for r in range(dp)]])
        dist.broadcast_object_list(plan, src=0)
        return plan[0]

    def _share(self, data):
        """This data-parallel rank's samples by the step's plan: its own that it keeps, and those moved to it
        from their ranks (only moved samples travel: one all-gather of them, none when nothing moves)."""
        import torch.distributed as dist
        from verl.utils import tensordict_utils as tu

        plan, _ = self._plan
        shares, rank, each = plan.steps[0], self.engine.get_data_parallel_rank(), len(data)
        owner = [p // each for p in range(each * plan.dp_size)]
        mine = [p - rank * each for p in shares[rank] if owner[p] == rank]
        if all(owner[p] == r for r, share in enumerate(shares) for p in share):
            return tu.index_select_tensor_dict(data, mine)
        leaving = {
            p: tu.index_select_tensor_dict(data, [p - rank * each])
            for r, share in enumerate(shares)
            if r != rank
            for p in share
            if owner[p] == rank
        }
        every: list = [None] * plan.dp_size
        dist.all_gather_object(every, leaving, group=self.engine.get_data_parallel_group())
        arriving = [every[owner[p]][p] for p in shares[rank] if owner[p] != rank]
        return tu.concat_tensordict(([tu.index_select_tensor_dict(data, mine)] if mine else []) + arriving)

    def _balance_metrics(self, global_lengths: list[int]) -> dict[str, float]:
        from .dispatch import plan_metrics

        plan, fit = self._plan
        metrics = plan_metrics(plan, global_lengths, fit or self._lb_mini.cost, "odc_balance")
        if fit is not None:
            slowest = min(range(plan.dp_size), key=lambda r: fit.speeds[r])
            tokens = [sum(global_lengths[p] for p in share) for share in plan.steps[0]]
            metrics["odc_balance/fit_error"] = fit.error
            metrics["odc_balance/rank_speed_min"] = fit.speeds[slowest]
            # below 1: the rank the fit finds slowest trains fewer tokens than the mean
            metrics["odc_balance/slowest_rank_tokens"] = tokens[slowest] * plan.dp_size / sum(tokens)
        return metrics


class _PlannedClient:
    """verl's TrainingWorker as the SFT trainer calls it: `train_batch` trains this rank's share of the plan,
    and every metric comes back as one number per key."""

    def __init__(self, client, trainer: _ODCSFT):
        self._client, self._trainer = client, trainer

    def __getattr__(self, name):
        return getattr(self._client, name)

    def train_batch(self, data):
        trainer = self._trainer
        planned = trainer._plan is not None
        if planned:
            start = time.perf_counter()
            data = trainer._share(data)
            trainer._balance_s["odc_balance/exchange_s"] = time.perf_counter() - start
        output = self._client.train_batch(data)
        if output is not None:
            from verl.utils import tensordict_utils as tu

            metrics = tu.get(output, "metrics")
            flatten_odc_metrics(metrics)
            if planned:
                metrics.update(trainer._balance_metrics(trainer._lengths), **trainer._balance_s)
        trainer._plan = None
        return output


def flatten_odc_metrics(metrics: dict) -> None:
    """ODC's per-rank lists (`odc/*`, gathered over ranks by verl's worker) as their mean (in place): every
    rank reports the same value of these, so the mean is that value."""
    for key, value in metrics.items():
        if key.startswith("odc/") and isinstance(value, list):
            metrics[key] = float(np.mean(value))
