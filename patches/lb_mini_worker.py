"""`TrainingWorker.train_mini_batch` runs the optimizer steps of an LB-Mini plan.

verl 0.9.1 (`verl/workers/engine_workers.py`) cuts a rank's data into pieces of
`mini_batch_size // dp` samples with `tu.make_iterator` (`epochs` passes, shuffled from
`seed + dp rank`), one optimizer step each. Under strategy=odc with LB-Mini the driver has already run
exactly that iterator for every rank and re-split each step's samples over the ranks
(`odc_plugin/verl/dispatch.py`); each rank receives the samples it needs and, in the non-tensor field
`odc_mini_batch_steps` (from the batch's extra_info), the indices of those it runs in each step. When
that field is there, the TrainingWorker of odc runs (a subclass, odc_patches.odc_subclass) runs those
steps instead of cutting its data itself (selecting with verl's own `index_select_tensor_dict`, as
`make_iterator` does); the rest of a step is verl's: the per-sequence token counts all-gathered for
MFU, the lr scheduler stepped on the last step only, `train_batch` per step, the
profiler step, and the metrics folded over ranks and steps as verl folds them (a metric an
engine reports as one value per rank is kept as such instead of failing verl's flattening).
A rank's multi-axis rope position ids (Qwen2-VL's) are laid out again before the steps are cut: verl's
`maybe_fix_3d_position_ids` corrupts those of a share of one sample, or of one length (odc_plugin/verl/
mrope_positions.py), which LB-Mini's uneven shares make common.
With `odc_split`, a step's split samples lead its share, their groups of ranks (`odc_split_steps`) go to
the engine with the step's data, and their tokens count once in the MFU counts.
`global_batch_size` stays the global mini-batch size, so the loss normalization is unchanged, and
every rank runs the same number of optimizer steps. Without the field (ODC runs balanced by lb_micro)
verl's method runs unchanged; runs without odc use verl's TrainingWorker itself.

Why a patch: verl has no hook inside train_mini_batch's loop, so the subclass's method re-implements it
for the plan's steps, and must follow verl's own line by line.

The driver reproduces verl's iterator from what this method does with it; `extend()` checks that the
method still forms its mini-batches that way (`_ITERATOR_RULES`), so that a verl change fails loudly here
instead of planning other mini-batches than verl trains on.

The actor reaches this through `ActorRolloutRefWorker.update_actor` (`engine_workers.py`), the
critic through its own `TrainingWorker` worker group; both therefore train on uneven shares.
"""

from __future__ import annotations

import functools
import inspect
from itertools import chain

from odc_patches import PatchError, parameters, require_attr

NAME = "lb_mini_worker"

# Names verl's train_mini_batch uses; if they change the method was rewritten and this patch must be too.
_ORIGINAL_USES = ("make_iterator", "train_batch", "all_gather_object", "aggregate_dp", "train_mode")
# How verl's train_mini_batch builds its mini-batches, which odc_plugin.verl.dispatch.verl_steps reproduces
# in the driver: the statements, whitespace aside.
_ITERATOR_RULES = (
    'epochs = tu.pop(data, key="epochs", default=1)',
    'seed = tu.pop(data, key="seed", default=42)',
    "mini_batch_size_per_gpu = batch_size_per_dp // num_mini_batch",
    "mini_batch_size_per_gpu = mini_batch_size // self.engine.get_data_parallel_size()",
    "dataloader = tu.make_iterator(data, mini_batch_size=mini_batch_size_per_gpu, epochs=epochs, "
    "seed=seed + self.engine.get_data_parallel_rank(), dataloader_kwargs=dataloader_kwargs,)",
)


def _original(current):
    """verl's undecorated train_mini_batch under its `@register` (register -> tqbridge -> function)."""
    from verl.single_controller.base.decorator import MAGIC_ATTR

    attrs = getattr(current, MAGIC_ATTR, None)
    if not isinstance(attrs, dict) or not isinstance(attrs.get("dispatch_mode"), dict):
        raise PatchError(
            f"odc patch '{NAME}': TrainingWorker.train_mini_batch is no longer registered with a dispatch function dict"
        )
    raw = getattr(getattr(current, "__wrapped__", None), "__wrapped__", None)
    if raw is None or getattr(raw, "__qualname__", "") != "TrainingWorker.train_mini_batch":
        raise PatchError(
            f"odc patch '{NAME}': TrainingWorker.train_mini_batch is not wrapped as "
            f"register(tqbridge(function)) any more"
        )
    if parameters(raw) != ["self", "data"]:
        raise PatchError(
            f"odc patch '{NAME}': TrainingWorker.train_mini_batch({', '.join(parameters(raw))}) is not (self, data)"
        )
    missing = [n for n in _ORIGINAL_USES if n not in raw.__code__.co_names]
    if missing:
        raise PatchError(
            f"odc patch '{NAME}': TrainingWorker.train_mini_batch no longer uses {missing}; "
            f"it was rewritten, re-check the patch"
        )
    source = "".join(inspect.getsource(raw).split())
    for rule in _ITERATOR_RULES:
        if "".join(rule.split()) not in source:
            raise PatchError(
                f"odc patch '{NAME}': TrainingWorker.train_mini_batch no longer has {rule!r}; odc's plans "
                f"reproduce how it forms mini-batches (odc_plugin.verl.dispatch.verl_steps)"
            )
    return attrs, raw


def _check_helpers():
    """What the uneven path calls besides the worker's own methods."""
    from verl.utils import py_functional, tensordict_utils
    from verl.utils.metric import utils as metric_utils
    from verl.workers.engine.base import BaseEngine

    for owner, name in (
        (tensordict_utils, "index_select_tensor_dict"),
        (tensordict_utils, "maybe_fix_3d_position_ids"),
        (tensordict_utils, "pop"),
        (tensordict_utils, "assign_non_tensor"),
        (tensordict_utils, "get_tensordict"),
        (metric_utils.Metric, "aggregate_dp"),
        (py_functional, "append_to_dict"),
        (BaseEngine, "train_mode"),
        (BaseEngine, "get_data_parallel_group"),
        (BaseEngine, "is_mp_src_rank_with_outputs"),
    ):
        require_attr(owner, name, NAME)


def extend(kind: str, base: type, members: dict) -> None:
    """The odc TrainingWorker's `train_mini_batch`: verl's, or the plan's steps when the batch carries them;
    registered with verl's own dispatch dict (lb_mini_dispatch then plans it)."""
    if kind != "training_worker":
        return
    from verl.single_controller.base.decorator import register

    attrs, raw = _original(require_attr(base, "train_mini_batch", NAME))
    _check_helpers()

    @functools.wraps(raw)
    def train_mini_batch(self, data):
        from verl.utils import tensordict_utils as tu

        from odc_plugin.verl.dispatch import SPLIT_STEPS_KEY, STEPS_KEY

        steps = tu.pop(data, key=STEPS_KEY, default=None)
        splits = tu.pop(data, key=SPLIT_STEPS_KEY, default=None)
        if steps is None:
            return raw(self, data)
        return _train_by_steps(self, data, [[int(i) for i in step] for step in steps], splits or [[] for _ in steps])

    members["train_mini_batch"] = register(
        dispatch_mode=attrs["dispatch_mode"], execute_mode=attrs["execute_mode"], blocking=attrs["blocking"]
    )(train_mini_batch)


def _train_by_steps(self, data, steps: list[list[int]], splits: list[list[list[int]]]):
    """verl's train_mini_batch loop over this rank's shares of the plan's steps (see the module docstring);
    `splits[s]`: the groups of ranks of step s's leading (split) samples (odc_split)."""
    import torch
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import Metric
    from verl.utils.py_functional import append_to_dict

    from odc_plugin.verl.mrope_positions import lay_out

    tu.maybe_fix_3d_position_ids(data)
    lay_out(data)  # a share of one sample, or of one length, which verl's fix above lays out wrongly
    disable_auto_offload = tu.pop(data, key="disable_auto_offload", default=False)
    # the driver ran verl's iterator with these already: the steps are its result
    for key in ("mini_batch_size", "num_mini_batch", "epochs", "seed", "dataloader_kwargs"):
        tu.pop(data, key=key, default=None)

    used = sorted({i for step in steps for i in step})
    if used != list(range(data.shape[0])) or min(map(len, steps), default=0) < 1:
        raise ValueError(
            f"odc: this rank holds {data.shape[0]} samples but its steps use {len(used)} of them "
            f"(every step needs at least one sample on every rank, every sample a step)"
        )
    group = self.engine.get_data_parallel_group()
    from odc_plugin.verl.split import SplitMicroBatches

    with self.engine.train_mode(disable_auto_offload=disable_auto_offload):
        outputs = []
        for step, indices in enumerate(steps):
            mini_batch = tu.index_select_tensor_dict(data, indices)
            tu.maybe_fix_3d_position_ids(mini_batch)
            SplitMicroBatches.give(mini_batch, splits[step])
            if "input_ids" in mini_batch:
                local = mini_batch["input_ids"].offsets().diff().tolist()
                elsewhere = set(SplitMicroBatches.counted_elsewhere(splits[step]))  # a split sample's tokens once
                local = [n for i, n in enumerate(local) if i not in elsewhere]
                gathered = [None] * torch.distributed.get_world_size(group)
                torch.distributed.all_gather_object(gathered, local, group)
                global_token_num = [n for rank in gathered for n in rank]
            else:
                global_token_num = None
            tu.assign_non_tensor(
                mini_batch,
                global_token_num=NonTensorData(global_token_num),
                update_lr_scheduler=step == len(steps) - 1,
                disable_auto_offload=True,
            )
            with torch.profiler.record_function(f"mini_batch{step}"):
                outputs.append(self.train_batch(mini_batch))
            self.profiler.step()

        if not self.engine.is_mp_src_rank_with_outputs():
            return None
        metrics = {}
        for output in outputs:
            step_metrics = dict(tu.get(output, "metrics"))
            for key, val in step_metrics.items():
                if not isinstance(val, list):  # loss, grad_norm, lr: already one value
                    continue
                if val and isinstance(val[0], Metric):  # one Metric per rank -> one over ranks
                    step_metrics[key] = Metric.aggregate_dp(val)
                else:  # per rank, a list of micro-batch values (verl) or a single value -> one flat list
                    step_metrics[key] = list(chain.from_iterable(v if isinstance(v, list) else [v] for v in val))
            append_to_dict(metrics, step_metrics)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()
