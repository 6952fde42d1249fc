"""verl's SFT trainers under odc: `torchrun -m verl.trainer.sft_trainer ... engine.strategy=odc` (SPMD) and
`python -m verl.trainer.sft_trainer_ray ... engine.strategy=odc` (a Ray driver).

verl's `SFTTrainer` classes get the choice of their class as its PPO trainers do (`patches/trainer_choice.py`):
a configuration whose `engine.strategy` is `odc` (or whose engine config group is the plugin's `odc`) gets
the subclass built here; any other gets verl's own class. The subclass

- builds the engine config as an `ODCEngineConfig` whichever way odc was named (`engine.strategy=odc` alone
  takes ODC's defaults; verl's FSDP engine config would refuse the strategy);
- under `odc_balancer=lb_mini`, splits each step's global batch over the data-parallel ranks with LB-Mini:
  the same plan as `main_ppo`'s dispatch (`dispatch.plan_steps`: verl's split unless LB-Mini's is predicted
  faster, with the engine's `auto` fit of each rank's speed), then each rank trains its share in as many
  micro-batches as it needs. verl's SFT loss divides by the global token count, summed over ranks by the
  engine, so the split changes no gradient.
  SPMD: every rank reads its own batch through verl's loader, whose lengths verl's trainer already
  all-gathers; global rank 0 plans them and broadcasts the plan; a rank keeps its own samples that the plan
  leaves it and receives the others from their ranks (one all-gather of the moved samples alone, none when
  nothing moves). With `odc_split=auto` the plan may split a step's longest samples over groups of ranks:
  each member receives the sample, first, with its group (odc_plugin/verl/split.py runs it).
  Ray: the driver reads the global batch (in the order `trainer.balance_batch` gives it), plans it with the
  fit the engine reported on the last step, and hands each worker its share through verl's dispatch;
- logs ODC's metrics as one number per key (`odc/*`) and the plan's balance (`odc_balance/*`).

The loaders, validation and checkpoints are verl's, so a checkpoint saved under one strategy resumes under
the other.
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np

from ..balance.common import chunk
from .config import config_value, is_vision_language

# verl's SFT trainer modules, and what odc changes in their trainers (`trainer_class`)
SPMD_MODULE, RAY_MODULE = "verl.trainer.sft_trainer", "verl.trainer.sft_trainer_ray"
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
    shares = {SPMD_MODULE: _SPMDShares, RAY_MODULE: _RayShares}.get(module_of(cls))
    if shares is None:
        raise ValueError(
            f"odc: {module_of(cls)}.{cls.__qualname__} is not supported with engine.strategy=odc; run one of verl's "
            f"SFT trainers (torchrun -m {SPMD_MODULE}, python -m {RAY_MODULE})"
        )
    return _subclass(cls, shares)


@functools.cache
def _subclass(cls: type, shares: type) -> type:
    return type(f"ODC{cls.__name__}", (shares, cls), {"__module__": __name__})


def _as_odc_engine_config(config) -> None:
    """`engine.strategy=odc` on verl's FSDP engine config: build ODC's config from the same keys instead."""
    from omegaconf import open_dict

    engine = config.engine
    if engine.get("_target_") == FSDP_ENGINE_CONFIG:
        with open_dict(engine):
            engine["_target_"] = ODC_ENGINE_CONFIG


class _ODCSFT:
    """What both trainers' odc subclasses share; `_plan` (the step's plan and its fit) is None when each rank
    keeps verl's share (lb_micro)."""

    _odc_trainer = True

    def _build_config(self):
        _as_odc_engine_config(self.config)
        super()._build_config()
        if is_vision_language(self.model_config.hf_config):
            # not yet run: whether a moved sample's pictures and multi-axis rope positions reach its new rank
            raise ValueError(
                "odc: verl's SFT trainers do not train a vision-language model under odc (not yet checked); "
                "set engine.strategy=fsdp2"
            )
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
        self._balance_s = {}

    def _build_engine(self):
        super()._build_engine()
        self.training_client = _PlannedClient(self.training_client, self)

    def _plan_of(self, lengths: list[int], dp: int):
        """LB-Mini's plan of one step over `dp` ranks, verl's share being each rank's contiguous chunk."""
        start = time.perf_counter()
        split = getattr(getattr(self, "engine", None), "odc_split", None)  # torchrun's engine, once built
        self._lb_mini.ulysses = split.model if split is not None else None  # the groups it built
        plan = self._lb_mini.plan(lengths, [chunk(list(range(len(lengths))), len(lengths) // dp)])
        self._balance_s["odc_balance/plan_s"] = time.perf_counter() - start
        return plan

    def _balance_metrics(self, global_lengths: list[int]) -> dict[str, float]:
        from .dispatch import plan_metrics

        plan, fit = self._plan
        metrics = plan_metrics(plan, global_lengths, fit or self._lb_mini.cost, "odc_balance")
        if fit is not None:
            slowest = min(range(plan.dp_size), key=lambda r: fit.speeds[r])
            tokens = [sum(plan.rank_items(0, r, global_lengths)) for r in range(plan.dp_size)]
            metrics["odc_balance/fit_error"] = fit.error
            metrics["odc_balance/rank_speed_min"] = fit.speeds[slowest]
            # below 1: the rank the fit finds slowest trains fewer tokens than the mean
            metrics["odc_balance/slowest_rank_tokens"] = tokens[slowest] * plan.dp_size / sum(tokens)
        return metrics


class _SPMDShares(_ODCSFT):
    """torchrun's trainer: every rank holds the plan and trains its share of the step."""

    def _get_batch_seqlens(self, data):
        """verl's: the step's lengths over all ranks, rank by rank (its one all-gather); under LB-Mini also
        this step's plan over them, global rank 0's on every rank (the Ulysses groups' ranks alike)."""
        import torch.distributed as dist

        lengths = super()._get_batch_seqlens(data)
        if self._lb_mini is not None:
            plan = [self._plan_of(lengths, self.engine.get_data_parallel_size()) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(plan, src=0)
            self._lengths, self._plan = lengths, plan[0]
        return lengths

    def _train(self, client, data):
        if self._plan is not None:
            start = time.perf_counter()
            data = self._share(data)
            self._balance_s["odc_balance/exchange_s"] = time.perf_counter() - start
        return client.train_batch(data)

    @staticmethod
    def _returned(output):
        return output

    def _share(self, data):
        """This data-parallel rank's samples by the step's plan: its own that it keeps, and those moved to it,
        each sent by its rank to the ranks that need it alone (none travel when nothing moves)."""
        from verl.utils import tensordict_utils as tu

        from .split import SplitMicroBatches

        plan, _ = self._plan
        rank, each = self.engine.get_data_parallel_rank(), len(data)
        needs = [plan.split_share(0, r)[0] for r in range(plan.dp_size)]
        positions, groups = plan.split_share(0, rank)
        if all(p // each == r for r, share in enumerate(needs) for p in share):
            share = tu.index_select_tensor_dict(data, [p - rank * each for p in positions])
        else:
            outgoing = [
                {p: tu.index_select_tensor_dict(data, [p - rank * each]) for p in share if p // each == rank}
                if r != rank
                else {}
                for r, share in enumerate(needs)
            ]
            incoming = _exchange(outgoing, self.engine.get_data_parallel_group())
            share = tu.concat_tensordict(
                [
                    tu.index_select_tensor_dict(data, [p - rank * each])
                    if p // each == rank
                    else incoming[p // each][p]
                    for p in positions
                ]
            )
        SplitMicroBatches.give(share, groups)
        return share


def _exchange(outgoing: list, group) -> list:
    """`outgoing[r]` (any picklable object) to rank r of `group` alone, for every r; returns what each rank
    sent this one. Two all-to-alls: the byte counts, then the bytes (on the group's device: NCCL's are
    GPUs)."""
    import pickle

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    payloads = [pickle.dumps(o) for o in outgoing]
    sizes = torch.tensor([len(b) for b in payloads], dtype=torch.int64, device=device)
    theirs = torch.empty_like(sizes)
    dist.all_to_all_single(theirs, sizes, group=group)
    joined = b"".join(payloads)
    send = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    received = torch.empty(int(theirs.sum()), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, send.to(device), theirs.tolist(), sizes.tolist(), group=group)
    raw, out, start = received.cpu().numpy().tobytes(), [], 0
    for n in theirs.tolist():
        out.append(pickle.loads(raw[start : start + n]))
        start += n
    return out


class _RayShares(_ODCSFT):
    """Ray's trainer: the driver plans the global batch and hands each worker its share."""

    def _build_config(self):
        from odc_patches.lb_mini_dispatch import check_dispatch

        check_dispatch()  # what run_on_pieces calls of verl's, checked before any worker starts
        super()._build_config()
        from .config import as_odc_config

        if as_odc_config(self.engine_config).odc_split == "auto":
            raise ValueError(
                "odc: odc_split=auto runs in verl's torchrun SFT trainer (torchrun -m verl.trainer.sft_trainer); "
                "set engine.odc_split=off for the Ray trainer"
            )

    def _build_engine(self):
        super()._build_engine()
        from odc_patches.lb_mini_dispatch import MESH_TRAIN, mesh_ranks

        self._dp_size = max(mesh_ranks(self.training_client, MESH_TRAIN)) + 1
        if self._lb_mini is not None and self.global_batch_size % self._dp_size:
            # verl's equal split refuses it at the first step; LB-Mini's plan starts from that split
            raise ValueError(
                f"odc: data.train_batch_size={self.global_batch_size} does not divide over the {self._dp_size} "
                f"data-parallel ranks; give it a multiple of {self._dp_size}"
            )

    def _train(self, client, data):
        if self._lb_mini is None:
            return client.train_batch(data).get()
        from verl.utils import tensordict_utils as tu

        from odc_patches.lb_mini_dispatch import MESH_TRAIN, run_on_pieces

        self._lengths = self._get_batch_seqlens(data).tolist()
        self._plan = self._plan_of(self._lengths, self._dp_size)
        start = time.perf_counter()
        pieces = [tu.index_select_tensor_dict(data, list(share)) for share in self._plan[0].steps[0]]
        output = run_on_pieces(client, "train_batch", MESH_TRAIN, pieces)
        self._balance_s["odc_balance/exchange_s"] = time.perf_counter() - start
        return output.get()

    @staticmethod
    def _returned(output):
        return _Done(output)  # verl's Ray trainer calls get() on what train_batch returns


class _PlannedClient:
    """verl's TrainingWorker (or Ray worker group) as the SFT trainer calls it: `train_batch` trains each
    rank's share of the plan, and every metric comes back as one number per key."""

    def __init__(self, client, trainer: _ODCSFT):
        self._client, self._trainer = client, trainer

    def __getattr__(self, name):
        return getattr(self._client, name)

    def train_batch(self, data):
        trainer = self._trainer
        output = trainer._train(self._client, data)
        if output is not None:
            from verl.utils import tensordict_utils as tu

            metrics = tu.get(output, "metrics")
            flatten_odc_metrics(metrics)
            if trainer._plan is not None:
                metrics.update(trainer._balance_metrics(trainer._lengths), **trainer._balance_s)
                # what the engine measured (its fit, its throughput): the next step's plan uses it
                observed = trainer._lb_mini.observe(metrics, "", trainer._plan[0], trainer._lengths)
                metrics.update({f"odc_balance/{key}": value for key, value in observed.items()})
        trainer._plan = None
        return trainer._returned(output)


class _Done:
    """A Ray call's output already gathered, as the trainer takes it (`get()`)."""

    def __init__(self, value):
        self._value = value

    def get(self):
        return self._value


def flatten_odc_metrics(metrics: dict) -> None:
    """ODC's per-rank lists (`odc/*`, gathered over ranks by verl's worker) as their mean (in place): every
    rank reports the same value of these, so the mean is that value."""
    for key, value in metrics.items():
        if key.startswith("odc/") and isinstance(value, list):
            metrics[key] = float(np.mean(value))
