"""The `odc` backend: verl's FSDP2 engines with ODC in place of FSDP's per-layer collectives.

Model building, offload, checkpointing, weight export and the optimizer step are verl's FSDP2 engine,
unchanged. What differs is one mini-batch (`forward_backward_batch`, used by training and by
log-prob / value inference alike):

- the global token count for loss normalization is still summed over ranks, once, before the mini-batch;
- each rank packs its own micro-batches with no cross-rank agreement on their number
  (verl's `same_micro_num_in_dp=True` is exactly the lockstep ODC removes); with a fixed micro-batch
  size, a share that does not divide by it ends in a smaller micro-batch (verl asserts that it divides);
- the micro-batches run between ODC's begin() and end(), so no collective runs inside but, with
  `odc_split=auto`, the all-to-alls of the samples the plan split over groups of ranks, within each group:
  they come first, one micro-batch each (odc_plugin/verl/split.py);
- per-micro-batch metrics are folded to one value per rank, since ranks now run different counts, so
  that verl's aggregation over ranks gives what it gives under fsdp2 (`_fold_metrics_over_ranks`);
- with `odc_cost_model=auto` every rank times its micro-batches, the ranks share the timings after the
  mini-batch, and each keeps the same online fit (odc_plugin.balance.online_fit), reported as
  `odc/fit_*` and `odc/rank_speed_<r>` metrics, from which the trainer plans the next mini-batches;
- on a mixture-of-experts model, each rank counts the tokens its routers sent to each expert, and the
  ranks' counts are compared after the mini-batch (`odc/moe/*` metrics, odc_plugin.moe).

Ulysses sequence parallelism (`ulysses_sequence_parallel_size` > 1) works as under `fsdp2`: ODC shards
and gets over all FSDP ranks; the ranks of one sequence-parallel group hold the same samples, pack the
same micro-batches (checked before the mini-batch) and exchange heads with verl's all-to-alls inside
their group; different groups run different micro-batch counts and meet once, at the end.

`fsdp_size` works as under `fsdp2`: smaller than the world size it builds verl's 2-D (ddp x fsdp) mesh,
HSDP, and ODC then gets and accumulates inside each fsdp group (one node) and all-reduces across the
groups once per mini-batch.

ODC's device memory follows the engine's phases: its regions (published shards, accumulator) exist only
while the engine computes. They are built at the start of a pass (`forward_backward_batch`; the accumulator
at the first pass that trains, so a trained model's log-probs hold its published copy alone; a rank whose
build fails fails it on every rank at once, naming that rank, as a failed mini-batch) and released
when verl leaves the engine's train or eval mode (the outermost, and only without an exception: all ranks
leave alike then), when it offloads the model to the CPU (`to`), and once the engine is initialized, so
that nothing of ODC's but its transport's control words is left on the device while the rollout (which
runs between phases, on the same GPUs) generates, offload on or off; the reference model's regions too.
A trained model's engine measures ODC's transport against the group's collectives once, when it is
initialized, at its own FSDP groups (comm/calibrate.py, a fraction of a second): the accumulate method
(`odc_accumulate`) is chosen there, one log line says what was measured, a warning where ODC's transport
is under half as fast, and the figures are reported with every update as `odc/transport/*`.
Metrics per role: `odc/held_outside_bytes` (what ODC's regions held when last released, measured: 0),
`odc/control_bytes`, `odc/extra_bytes_per_param` during a mini-batch, `odc/forward_only_extra_bytes_per_param`
during the model's last forward-only pass (its log-probs or values: the published copy alone, no accumulator),
`odc/rebuild_s` (building and releasing since the last report, so per step); the reference model's, which
verl keeps no metrics of, under the actor's as `odc/ref/*` (it lives in the actor's processes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
from verl.workers.utils.losses import sft_loss

import odc_patches

from ..balance.online_fit import MicroBatchTime, OnlineTimeFit
from ..comm import ODCPeerFailedError, make_transport
from ..comm.calibrate import TransportCalibration
from ..fsdp import ODCConfig, apply_odc, shard_group
from ..fsdp.odc import ODCMemory
from ..moe import ExpertRouting, routing_metrics
from . import mrope_positions
from .config import as_odc_config
from .dispatch import STEPS_KEY
from .split import SplitMicroBatches

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))  # verl's own modules' convention
# Below this (the collectives' time over ODC's transport's), the run warns at start that odc will likely be slower.
SLOW_TRANSPORT_RATIO = 0.5
# The odc engines of this process: a trained one reports the forward-only ones' memory (the reference model's)
_ENGINES: weakref.WeakSet = weakref.WeakSet()


@contextlib.contextmanager
def _built_as_fsdp2(engine_config):
    """Let verl's own FSDP2 branch build the module: ODC starts from exactly what `fsdp2` builds."""
    # verl's configs are frozen dataclasses; verl itself sets `strategy` this way in its role configs.
    object.__setattr__(engine_config, "strategy", "fsdp2")
    try:
        yield
    finally:
        object.__setattr__(engine_config, "strategy", "odc")


class _ODCEngineMixin:
    """Overrides shared by the language-model (actor, ref) and value-model (critic) engines."""

    def _init_device_mesh(self):
        # the first thing verl's engine init calls: an odc engine on a verl the patches were not written for
        # fails here, in one line, on every rank alike
        odc_patches.require_odc_verl()
        # verl would hand a bad fsdp_size to init_device_mesh, whose error names neither the key nor the fix.
        fsdp_size, world_size = self.engine_config.fsdp_size, dist.get_world_size()
        if 0 <= fsdp_size < world_size and (fsdp_size < 2 or world_size % fsdp_size):
            raise ValueError(
                f"fsdp_size={fsdp_size} must divide the world size {world_size} and be at least 2 "
                f"with strategy odc (ranks per node for HSDP; -1 shards over all ranks)"
            )
        super()._init_device_mesh()

    def _build_fsdp_module(self, module):
        odc_config = as_odc_config(self.engine_config)
        with _built_as_fsdp2(self.engine_config):
            module = super()._build_fsdp_module(module)
        transport = make_transport(
            odc_config.odc_transport, group=shard_group(module), accumulate=odc_config.odc_accumulate
        )
        self.odc = apply_odc(
            module,
            transport,
            ODCConfig(
                barrier_timeout_s=odc_config.odc_barrier_timeout_s,
                lockstep=odc_config.odc_lockstep,
                trains=not self.engine_config.forward_only,  # the reference model: no gradient accumulator
            ),
        )
        self.odc_time_fit = (
            OnlineTimeFit(self.get_data_parallel_size()) if odc_config.odc_cost_model == "auto" else None
        )
        self.expert_routing = ExpertRouting.of(module)
        self.odc_split = SplitMicroBatches(self) if odc_config.odc_split == "auto" else None
        self.odc_calibration: TransportCalibration | None = None  # a trained model's, once initialized
        self._odc_phases = 0  # train/eval modes entered and not left
        self._odc_held_outside = 0  # ODC's bytes, control words aside, when it was last released
        self._odc_forward_only_memory: ODCMemory | None = None  # in this engine's last forward-only pass
        self._odc_reported_s: dict[int, float] = {}  # build_s of each engine this one last reported
        _ENGINES.add(self)
        replicas = self.odc.mesh.num_replicas
        logger.info(
            "odc: %s%s on %d ranks over %s%s",
            type(self).__name__,
            " (forward only)" if self.engine_config.forward_only else "",
            transport.world_size * replicas,
            type(transport).__name__,
            f" (HSDP: {replicas} replicas of {transport.world_size}-rank shard groups)" if replicas > 1 else "",
        )
        return module

    def initialize(self):
        super().initialize()
        if self.odc_split is not None:
            with self.eval_mode():
                self.odc_split.check(self)
        self._odc_release()  # nothing held until the engine first computes: the rollout starts after this
        self.odc_calibration = None if self.engine_config.forward_only else self._odc_calibrate()

    def _odc_calibrate(self) -> TransportCalibration:
        """ODC's transport against the group's collectives at this model's FSDP groups, once, before the
        accumulator is first built: the accumulate method it will use (odc_accumulate), one log line, a warning
        where ODC's transport is much slower than the collectives it replaces."""
        forced = as_odc_config(self.engine_config).odc_accumulate
        budget = None
        if forced == "auto" and torch.cuda.is_available() and torch.cuda.is_initialized():
            budget = torch.cuda.mem_get_info()[0] // 4  # slots only where they leave the GPU room to train
        calibration = self.odc.calibrate(None if forced == "auto" else [forced], budget)
        role = type(self).__name__
        logger.info(
            "odc: %s: %s; accumulate method '%s' (odc_accumulate=%s)",
            role,
            calibration.summary(),
            calibration.chosen,
            forced,
        )
        if calibration.ratio < SLOW_TRANSPORT_RATIO:
            logger.warning(
                "odc: %s: ODC's transport is only %.2fx %s's collectives on these ranks: strategy=odc will likely "
                "train slower than strategy=fsdp2 unless the work is very uneven; compare the two (odc-check, or "
                "odc-grpo-cpu's A/B on your own config)",
                role,
                calibration.ratio,
                calibration.backend,
            )
        return calibration

    def train_mode(self, **kwargs):
        return self._odc_phase(super().train_mode(**kwargs))

    def eval_mode(self, **kwargs):
        return self._odc_phase(super().eval_mode(**kwargs))

    @contextlib.contextmanager
    def _odc_phase(self, mode):
        """verl's train or eval mode; ODC's regions go when the outermost one is left (verl nests them: the
        update's mini-batches run in modes of their own inside the update's). An exception leaves them: a
        release is collective, and a rank alone in an exception may have peers elsewhere."""
        self._odc_phases += 1
        try:
            with mode:
                yield
        finally:
            self._odc_phases -= 1
        if self._odc_phases == 0:
            self._odc_release()

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        # offloading inside a mode (verl's on leaving one) waits for the mode's end, where the release is
        if device == "cpu" and model and self._odc_phases == 0:
            self._odc_release()

    def _odc_release(self) -> None:
        self.odc.release()
        # measured where the system keeps it (a region freed while something still views it counts)
        self._odc_held_outside = self.odc.transport.held_bytes()

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        with self.odc_split.renewed() if self.odc_split is not None else contextlib.nullcontext():
            return self._odc_forward_backward_batch(data, loss_function, forward_only)

    def _odc_forward_backward_batch(self, data, loss_function, forward_only):
        # collective, before anything of the pass that may fail on one rank alone; the accumulator only for a
        # pass that trains (a trained model's log-probs hold the published copy alone)
        self.odc.build(backward=not forward_only)
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        tu.pop(data, key=STEPS_KEY, default=None)  # a forward-only pass's share of an LB-Mini plan: one step, all
        mrope_positions.lay_out(data)  # a share of one sample, or of one length, as verl's packing reads it
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)

        groups = SplitMicroBatches.take(data)  # the groups of its leading split samples (odc_split)
        batch_num_tokens = self._batch_num_tokens(data, groups, loss_function)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens, dp_size=self.get_data_parallel_size())

        # a rank whose packing raises (a bad batch) fails the mini-batch its peers begin (OnDemandComm.abort)
        with self.odc.guard():
            micro_batches, indices = self._micro_batches_with_splits(data, groups)
        scaler = getattr(self, "scaler", None)
        outputs = []
        clock = _MicroBatchClock(timed=self.odc_time_fit is not None and not forward_only)
        if self.expert_routing is not None:
            self.expert_routing.take()  # count this mini-batch's routing only
        # a micro-batch that raises ends the mini-batch on every rank at once (OnDemandComm.abort)
        with self.odc.minibatch(backward=not forward_only):
            if self.ulysses_sequence_parallel_size > 1:
                self._check_sequence_parallel_group_agrees(micro_batches)
            for i, micro_batch in enumerate(micro_batches):
                split = groups[i] if i < len(groups) else None
                if split is None:  # a split micro-batch's time is not its lengths' on one rank: not for the fit
                    clock.start(micro_batch)
                last = i == len(micro_batches) - 1
                sync = (
                    contextlib.nullcontext() if forward_only else self._gradient_sync_context(is_last_micro_batch=last)
                )
                with (
                    torch.no_grad() if forward_only else contextlib.nullcontext(),
                    sync,
                    self.odc_split.running(self, split) if split else contextlib.nullcontext(),
                ):
                    loss, meta = self.forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
                    if split:
                        loss = SplitMicroBatches.count_once(loss, meta, split)
                    if not forward_only:
                        (scaler.scale(loss) if scaler is not None else loss).backward()
                        if not return_model_output:
                            meta.pop("model_output", None)  # keeping every micro-batch's logits would pile up
                if split is None:
                    clock.stop()
                outputs.append(meta)
        stats = self.odc.last_stats
        if forward_only:
            self._odc_forward_only_memory = self.odc.minibatch_memory

        output = postprocess_batch_func(output_lst=outputs, indices=indices, data=data)
        # What is reported per step, not per mini-batch, goes with the update's last one (verl marks it for its lr
        # scheduler): reported for every mini-batch, verl's metric reduction would hand the trainer their mean.
        last = tu.get_non_tensor_data(data=data, key="update_lr_scheduler", default=True)
        # A pass without a loss (log-probs, values) has no metrics to fold, and verl's trainer keeps none of its
        # metrics: no collective for them (one costs ~0.1 s among 32 processes on 2 cores: odc-grpo-cpu --emulate)
        metrics = output.get("metrics") if isinstance(output, dict) else None
        if not isinstance(metrics, dict):
            # verl's engine hands back whatever its post-processing gives; odc reports into a dict only, and still
            # runs its collectives, as every rank does
            metrics = {}
        if loss_function is not None:
            self._fold_metrics_over_ranks(metrics)
            metrics.update(self._odc_metrics(stats, len(micro_batches), last, groups))
        if clock.timed:
            # the fit after the update's last mini-batch plans the next step
            fit = self._refit(clock.seconds())
            metrics.update(fit if last else {})
        if self.expert_routing is not None and not forward_only:
            metrics.update(self._routing_metrics())
        return output

    def _batch_num_tokens(self, data, groups: list[list[int]], loss_function):
        """The one collective of a mini-batch, before it starts: the loss divides by the token count of the
        whole mini-batch, so the update does not depend on how samples are spread over ranks; a split sample
        counts once (`groups`: those of the leading split samples). A rank whose
        own count raises still takes part, counting a failure, so that no peer waits in the collective:
        every rank then fails the mini-batch (OnDemandComm.abort), its peers naming that rank."""
        failure = None
        try:
            if groups and self.odc_split is None:
                raise ValueError("odc: the plan split samples over groups of ranks, but this engine has odc_split=off")
            _refuse_a_loss_across_samples(data, loss_function, as_odc_config(self.engine_config).odc_balancer)
            mine = data["loss_mask"].sum() - SplitMicroBatches.others_tokens(data, groups)
            both = torch.stack([mine.to(torch.float64), torch.zeros((), dtype=torch.float64, device=mine.device)])
        except Exception as e:  # noqa: BLE001  (announced to every rank below)
            failure, both = e, torch.tensor([0.0, 1.0], dtype=torch.float64)
        both = both.to(get_device_id())
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self.get_data_parallel_group())
        if failure is not None:
            raise self.odc.abort(failure)
        if both[1]:
            raise self.odc.abort(ODCPeerFailedError(f"rank {dist.get_rank()}: a peer failed preparing its mini-batch"))
        return float(both[0]) if mine.is_floating_point() else int(both[0])  # float64: exact up to 2**53

    def _micro_batches_with_splits(self, data, groups: list[list[int]]):
        """The leading split samples one micro-batch each, then the rest as `_micro_batches` packs it."""
        if not groups:
            return self._micro_batches(data)
        singles, rest = SplitMicroBatches.split_off(data, groups)
        packed, indices = self._micro_batches(rest) if rest is not None else ([], [])
        if indices is not None:
            indices = [[i] for i in range(len(groups))] + [[len(groups) + i for i in mb] for mb in indices]
        return singles + packed, indices

    def _micro_batches(self, data):
        """This rank's micro-batches, packed without agreeing on their number with the other ranks.

        With a fixed micro-batch size the share is cut in order into pieces of that size and a smaller
        last one: under LB-Mini a rank's share need not divide by it, which verl's own preparation asserts.
        Every loss verl normalizes by the whole mini-batch (`batch_num_tokens`, `global_batch_size`, `dp_size`),
        so how a share is cut changes nothing but the float rounding of the sums; a loss whose gradient does
        depend on it (`seq-mean-token-sum-norm` without `loss_scale_factor`, GMPO, Clip-Cov) is refused at
        start by the loss probe (verl/loss_probe.py).
        """
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            # the lockstep baseline runs every rank through as many micro-batches as the busiest, as fsdp2 does
            lockstep = self.odc.config.lockstep
            return prepare_micro_batches(
                data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=lockstep
            )
        group = tu.get_non_tensor_data(data=data, key="force_group_size", default=1)
        if len(data) % group:
            raise ValueError(
                f"odc: this rank's {len(data)} samples do not make whole groups of force_group_size={group}"
            )
        size = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None) * group
        pieces = [list(range(i, min(i + size, len(data)))) for i in range(0, len(data), size)]
        return [tu.index_select_tensor_dict(data, piece) for piece in pieces], None

    def _fold_metrics_over_ranks(self, metrics: dict) -> None:
        """Fold each Metric of this mini-batch to one value per rank such that verl's aggregation over ranks
        (`Metric.aggregate_dp`, which needs as many values on every rank and weighs each position alike) gives
        what it gives under fsdp2, where every rank runs as many micro-batches: a mean weighs every
        micro-batch of every rank alike, so each rank takes the mean over all ranks' micro-batch values (a
        collective, after the mini-batch has ended); a sum is each rank's own sum, since verl averages the
        ranks' sums; a min or max each rank's own. Exact but for float rounding."""
        means = {
            key: (sum(value.values), len(value.values))
            for key, value in metrics.items()
            if isinstance(value, Metric) and value.aggregation == AggregationType.MEAN
        }
        every: list = [None] * self.get_data_parallel_size()
        dist.all_gather_object(every, means, group=self.get_data_parallel_group())
        for key, value in metrics.items():
            # a rank whose micro-batches were all split samples it does not count (count_once) has no values
            # of a mean, and still takes the mean of the others'
            if not isinstance(value, Metric) or not (value.values or key in means):
                continue
            folded = value.init_list()
            if key in means:
                folded.append(sum(r[key][0] for r in every) / sum(r[key][1] for r in every))
            else:
                folded.append(value.aggregate())
            metrics[key] = folded

    def _routing_metrics(self) -> dict[str, list[float]]:
        """Each rank's tokens per expert in this mini-batch, compared across ranks (a collective, after the
        mini-batch has ended): `odc/moe/expert_load_max_<r>`, `idle_experts_<r>`, `routing_divergence`."""
        every: list = [None] * self.get_data_parallel_size()
        dist.all_gather_object(every, self.expert_routing.take(), group=self.get_data_parallel_group())
        return {f"odc/moe/{key}": [value] for key, value in routing_metrics(every).items()}

    def _check_sequence_parallel_group_agrees(self, micro_batches) -> None:
        """The ranks of a Ulysses group exchange attention heads in every layer of every micro-batch, so
        they must run the same micro-batches; a group whose ranks received different samples would hang
        in that exchange or mix sequences. One collective inside the group, before the first micro-batch;
        inside the mini-batch, so that the other groups learn of the refusal at once."""
        mine = [_sequence_lengths(mb) for mb in micro_batches]
        group = self.ulysses_parallel_group
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        if any(theirs != mine for theirs in every):
            raise ValueError(
                f"the ranks {dist.get_process_group_ranks(group)} of one sequence-parallel group must run the same "
                f"micro-batches, got {[len(m) for m in every]} micro-batches of "
                f"{[sum(map(len, m)) for m in every]} sequences: every rank of a group must receive the same samples"
            )

    def _refit(self, timings: list[tuple[tuple[int, ...], float]]) -> dict[str, list[float]]:
        """Share this mini-batch's micro-batch timings with every rank (a collective, after the mini-batch
        has ended) and refit the auto cost; the fit, and each rank's speed, as metrics."""
        every: list = [None] * self.get_data_parallel_size()
        dist.all_gather_object(every, timings, group=self.get_data_parallel_group())
        fit = self.odc_time_fit.add(
            MicroBatchTime(rank, lengths, seconds) for rank, mine in enumerate(every) for lengths, seconds in mine
        )
        if fit is None:
            return {}
        values = {
            "odc/fit_c": fit.c,
            "odc/fit_a": fit.a,
            "odc/fit_b": fit.b,
            "odc/fit_timings": float(fit.timings),
            "odc/fit_error": fit.error,
        }
        values.update({f"odc/rank_speed_{r}": v for r, v in enumerate(fit.speeds)})
        return {key: [value] for key, value in values.items()}

    def _odc_memory(self, last: bool) -> dict[str, float]:
        """This rank's ODC memory figures, max over ranks when reported: this engine's, and with the update's
        last mini-batch the seconds spent building and releasing since the last report; the forward-only odc
        engines of this process (the reference model's) under `ref/`, with the update's last mini-batch."""
        values, engines = {}, [("", self)]
        if last:
            forward_only = [e for e in _ENGINES if e is not self and e.engine_config.forward_only]
            engines += [(f"ref{i if len(forward_only) > 1 else ''}/", e) for i, e in enumerate(forward_only)]
        for prefix, engine in engines:
            during = engine.odc.minibatch_memory
            values[f"odc/{prefix}held_outside_bytes"] = float(engine._odc_held_outside)
            values[f"odc/{prefix}control_bytes"] = float(engine.odc.transport.control_bytes())
            values[f"odc/{prefix}extra_bytes_per_param"] = during.extra_bytes_per_param if during else 0.0
            if last:
                spent = engine.odc.build_s - self._odc_reported_s.get(id(engine), 0.0)
                self._odc_reported_s[id(engine)] = engine.odc.build_s
                values[f"odc/{prefix}rebuild_s"] = spent
        if last:
            forward = self._odc_forward_only_memory
            values["odc/forward_only_extra_bytes_per_param"] = forward.extra_bytes_per_param if forward else 0.0
        return values

    def _odc_metrics(self, stats, num_micro_batches: int, last: bool, groups: list[list[int]]) -> dict[str, float]:
        """Compute and barrier-wait time over ranks, the split samples, and ODC's memory (a collective, after
        the mini-batch has ended)."""
        memory = self._odc_memory(last)
        firsts = sum(g[0] == dist.get_rank() for g in groups)
        mine = torch.tensor(
            [stats.compute_s, stats.wait_s, float(num_micro_batches), firsts, max(map(len, groups), default=1)]
            + list(memory.values()),
            dtype=torch.float64,
            device=get_device_id(),
        )
        every = [torch.empty_like(mine) for _ in range(self.get_data_parallel_size())]
        dist.all_gather(every, mine, group=self.get_data_parallel_group())
        gathered = torch.stack(every).cpu()
        compute, wait, micro, firsts, largest = gathered[:, :5].unbind(1)
        values = {
            "odc/compute_s_mean": compute.mean(),
            "odc/compute_s_max": compute.max(),
            "odc/wait_s_mean": wait.mean(),
            "odc/wait_s_max": wait.max(),
            # 1.0 means perfectly balanced compute; the slowest rank sets the mini-batch's time
            "odc/compute_imbalance": compute.max() / compute.mean().clamp_min(1e-9),
            "odc/micro_batches_min": micro.min(),
            "odc/micro_batches_max": micro.max(),
            # samples split over groups of ranks (odc_split), and the largest group
            **({"odc/split/samples": firsts.sum(), "odc/split/max_group": largest.max()} if self.odc_split else {}),
            # memory, the largest over ranks: extra_bytes_per_param is what ODC holds beyond FSDP2 during a
            # mini-batch per parameter of a rank's shards (published shards, accumulator padding and flags,
            # the zeros `.grad` points at): about 2 under bf16 mixed precision, and the largest shard's 4 bytes
            # over the shards' elements while a backward runs. The time spent building and releasing, the least
            # over ranks: building is collective, so a rank's time also holds its wait for the last rank to
            # arrive, which it would otherwise spend at the pass's first collective; every rank's holds each
            # build's time after the last arrival, so the least is still at least what the step spends.
            **{
                key: column.min() if key.endswith("rebuild_s") else column.max()
                for key, column in zip(memory, gathered[:, 5:].unbind(1))
            },
        }
        values = {key: value.item() for key, value in values.items()}
        if self.odc_calibration is not None:  # alike on every rank and mini-batch: their mean is themselves
            values.update(self.odc_calibration.metrics())
        if self.odc_split is not None:  # so are the split's groups and its start-up check
            values.update(self.odc_split.metrics)
        # lists, like the loss function's own per-micro-batch metrics, which verl's worker flattens
        return {key: [value] for key, value in values.items()}


def _refuse_a_loss_across_samples(data, loss_function, balancer: str) -> None:
    """verl's SFT loss shifts the loss mask over a packed micro-batch as a whole, so where a sample's first token
    carries loss, the packed sample before it (or the micro-batch's last, for its first) is trained to predict
    that token: its gradient depends on which samples are packed together, and LB-Mini packs others than
    fsdp2. verl's multi-turn SFT data leave a conversation's first token out of the loss. A micro-batch of one
    sample (a fixed micro-batch size of 1) has no neighbour: it trains as under fsdp2."""
    if balancer != "lb_mini" or getattr(loss_function, "func", None) is not sft_loss:
        return
    if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        if tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None) == 1:
            return
    mask = data["loss_mask"]
    firsts = mask.values()[mask.offsets()[:-1]] if mask.is_nested else mask[:, 0]
    if firsts.any():
        raise ValueError(
            f"odc: {int(firsts.count_nonzero())} samples' first token carries loss, which verl's sft_loss trains "
            "the sample packed before it to predict, so the gradient depends on which samples LB-Mini packs "
            "together; leave each sample's first token out of loss_mask, or set odc_balancer=lb_micro"
        )


class _MicroBatchClock:
    """Compute seconds and sequence lengths of each micro-batch of a mini-batch: CUDA events on a GPU
    (read once the mini-batch is over, so nothing waits for the GPU inside it), wall time on CPU."""

    def __init__(self, timed: bool):
        self.timed = timed
        self.cuda = timed and torch.cuda.is_available() and torch.cuda.is_initialized()
        self._marks: list = []
        self._lengths: list[tuple[int, ...]] = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, micro_batch) -> None:
        if self.timed:
            self._lengths.append(_sequence_lengths(micro_batch))
            self._marks.append([self._mark()])

    def stop(self) -> None:
        if self.timed:
            self._marks[-1].append(self._mark())

    def seconds(self) -> list[tuple[tuple[int, ...], float]]:
        """(lengths, seconds) per micro-batch."""
        if self.cuda:
            torch.cuda.synchronize()
            spans = [start.elapsed_time(end) / 1000 for start, end in self._marks]
        else:
            spans = [end - start for start, end in self._marks]
        return list(zip(self._lengths, spans))


def _sequence_lengths(micro_batch) -> tuple[int, ...]:
    """Token count of each sequence of a micro-batch (remove-padding layout, or a padded one)."""
    input_ids = micro_batch["input_ids"]
    if input_ids.is_nested:
        return tuple(input_ids.offsets().diff().tolist())
    if "attention_mask" in micro_batch.keys():
        return tuple(micro_batch["attention_mask"].sum(-1).tolist())
    return (input_ids.shape[-1],) * input_ids.shape[0]


class ODCEngineWithLMHead(_ODCEngineMixin, FSDPEngineWithLMHead):
    """Actor and reference model."""


class ODCEngineWithValueHead(_ODCEngineMixin, FSDPEngineWithValueHead):
    """Critic."""


DEVICES = ["cuda", "cpu"]


def register() -> None:
    """The odc engines join verl's EngineRegistry, for cuda and cpu (once: a reload imports this again)."""
    from verl.workers.engine import EngineRegistry

    for model_type, engine_cls in (("language_model", ODCEngineWithLMHead), ("value_model", ODCEngineWithValueHead)):
        if EngineRegistry._engines.get(model_type, {}).get("odc") is None:
            EngineRegistry.register(model_type, "odc", device=DEVICES)(engine_cls)


# Importing this module registers its engines: the plugin registers them when verl's engine package is
# imported (odc_plugin/verl/plugin.py), and when this module is what imports that package, the classes
# are not defined yet at that moment.
register()
