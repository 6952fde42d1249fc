"""verl's SPMD SFT trainer under odc (`torchrun -m verl.trainer.sft_trainer ... engine.strategy=odc`).

verl's `SFTTrainer` gets the choice of its class as its PPO trainers do (`patches/trainer_choice.py`): a
configuration whose `engine.strategy` is `odc` (or whose engine config group is the plugin's `odc`) gets
the subclass built here; any other gets verl's own class. The subclass

- builds the engine config as an `ODCEngineConfig` whichever way odc was named (`engine.strategy=odc` alone
  takes ODC's defaults; verl's FSDP engine config would refuse the strategy);
- under `odc_balancer=lb_mini`, has every rank read the whole global batch of each step (the samples the
  ranks' `DistributedSampler`s give them together under fsdp2, in the same order, with the same loader
  state for resume: one sampler over all ranks, whose batch of `train_batch_size` samples is the fsdp2
  ranks' batches interleaved), splits it over the data-parallel ranks with LB-Mini (the same plan as
  `main_ppo`'s dispatch, `dispatch.plan_steps`: verl's split unless LB-Mini's is predicted faster, with the
  engine's `auto` fit of each rank's speed), data-parallel rank 0's plan broadcast to every rank (the one
  small collective the balancing adds per step), and trains each rank's share in as many micro-batches as
  it needs. verl's SFT loss divides by the global token count, summed over ranks by the engine, so the
  split changes no gradient;
- logs ODC's metrics as one number per key (`odc/*`) and the plan's balance (`odc_balance/*`).

Validation and checkpoints are verl's: the validation loader is stock, and a checkpoint saved under one
strategy resumes under the other (the loaders yield the same batches, one per step).
"""

from __future__ import annotations

import functools
import sys

import numpy as np
from torchdata.stateful_dataloader import StatefulDataLoader

from .trainer import config_value

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

    def _build_dataloader(self):
        super()._build_dataloader()
        if self._lb_mini is None:
            return
        from torch.utils.data import DistributedSampler

        # verl's samplers over dp ranks, interleaved: one sampler, the same seed, dp batches at a time
        self.train_sampler = DistributedSampler(
            self.train_dataset, shuffle=True, num_replicas=1, rank=0, drop_last=True
        )
        loader = self.train_dataloader
        self.train_dataloader = GlobalBatchLoader(
            self.engine.get_data_parallel_size(),
            dataset=self.train_dataset,
            batch_size=self.train_batch_size_per_dp * self.engine.get_data_parallel_size(),
            sampler=self.train_sampler,
            collate_fn=self.collate_fn,
            num_workers=loader.num_workers,
            pin_memory=False,
            drop_last=True,
            pin_memory_device=loader.pin_memory_device,
        )

    def _build_engine(self):
        super()._build_engine()
        self.training_client = _PlannedClient(self.training_client, self)

    def _get_batch_seqlens(self, data):
        """Under LB-Mini `data` is the global batch: its lengths in the order fsdp2's ranks gather them, and
        this step's plan; else verl's."""
        if self._lb_mini is None:
            return super()._get_batch_seqlens(data)
        lengths = _lengths(data)
        dp = self.engine.get_data_parallel_size()
        self._plan = self._plan_step(lengths, dp)
        return [lengths[p] for r in range(dp) for p in range(r, len(lengths), dp)]

    def _plan_step(self, lengths: list[int], dp: int):
        """Data-parallel rank 0's LB-Mini plan of one step, on every rank."""
        import torch.distributed as dist

        plan = [None]
        if dist.get_rank() == 0:
            fit = getattr(self.engine, "odc_time_fit", None)
            self._lb_mini.fit = fit.fit if fit is not None else None
            stock = [[list(range(r, len(lengths), dp)) for r in range(dp)]]
            plan[0] = self._lb_mini.plan(lengths, stock)
        dist.broadcast_object_list(plan, src=0)
        return plan[0]

    def _share(self, data):
        """This data-parallel rank's samples of the global batch, by the step's plan."""
        from verl.utils import tensordict_utils as tu

        plan, _ = self._plan
        return tu.index_select_tensor_dict(data, list(plan.steps[0][self.engine.get_data_parallel_rank()]))

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
        lengths = _lengths(data) if planned else None
        output = self._client.train_batch(trainer._share(data) if planned else data)
        if output is not None:
            from verl.utils import tensordict_utils as tu

            metrics = tu.get(output, "metrics")
            flatten_odc_metrics(metrics)
            if planned:
                metrics.update(trainer._balance_metrics(lengths))
        trainer._plan = None
        return output


class GlobalBatchLoader(StatefulDataLoader):
    """A loader of the global batch whose state is saved and loaded as one data-parallel rank's loader's
    under fsdp2 (the samples its sampler has yielded counted per rank), so that a checkpoint of either
    strategy resumes under the other at the same step."""

    def __init__(self, dp_size: int, **kwargs):
        self._dp_size = dp_size
        super().__init__(**kwargs)

    def state_dict(self):
        return _samples_yielded_scaled(super().state_dict(), 1, self._dp_size)

    def load_state_dict(self, state_dict):
        super().load_state_dict(_samples_yielded_scaled(state_dict, self._dp_size, 1))


def _samples_yielded_scaled(state: dict, num: int, den: int) -> dict:
    sampler = state.get("_sampler_iter_state")
    if sampler is None:
        return state
    if "samples_yielded" not in sampler or sampler["samples_yielded"] * num % den:
        raise ValueError(
            f"odc: the SFT data loader's state {sampler} is not one odc can carry between strategies (torchdata's "
            f"samples_yielded, a whole number per rank); resume with the strategy that saved it"
        )
    return {**state, "_sampler_iter_state": {**sampler, "samples_yielded": sampler["samples_yielded"] * num // den}}


def flatten_odc_metrics(metrics: dict) -> None:
    """ODC's per-rank lists (`odc/*`, gathered over ranks by verl's worker) as their mean (in place): every
    rank reports the same value of these, so the mean is that value."""
    for key, value in metrics.items():
        if key.startswith("odc/") and isinstance(value, list):
            metrics[key] = float(np.mean(value))


def _lengths(data) -> list[int]:
    input_ids = data["input_ids"]
    if input_ids.is_nested:
        return input_ids.offsets().diff().tolist()
    return data["attention_mask"].sum(dim=-1).tolist()
