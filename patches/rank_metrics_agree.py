"""Under `strategy=odc`, the per-rank readings in a pass's metrics are made the same on every rank.

verl 0.9.1's `TrainingWorker._postprocess_output` (`verl/workers/engine_workers.py`) gathers the
loss function's metrics over the data-parallel group, but adds readings each rank takes alone: device
and host memory (`perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb`,
`perf/cpu_memory_used_gb`) and `mfu` (from the rank's own elapsed time). The v1 trainer then merges the
ranks' outputs and fails when their metrics differ ("KVBatchMeta.concat: extra_info key 'metrics' has
conflicting values across chunks"). Under lockstep the ranks take those readings at nearly the same
moment; under ODC a rank with a smaller LB-Mini share finishes a forward-only pass early, and the host
memory it reads then differs from its peers'. The TrainingWorker of odc runs (a subclass,
odc_patches.odc_subclass) takes each such reading's maximum over the group (mfu: the mean), for odc
engines only.

Why a patch: verl takes the readings inside `_postprocess_output`, with no hook between taking and
returning them; the subclass's method runs verl's and then agrees on them.
"""

from __future__ import annotations

import functools
import inspect

from odc_patches import PatchError, parameters, require_attr

NAME = "rank_metrics_agree"

_PARAMS = ["self", "output", "global_token_num", "delta_time", "forward_only", "images_seqlens"]
PER_RANK_MAX = ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb")
PER_RANK_MEAN = ("mfu",)


def extend(kind: str, base: type, members: dict) -> None:
    """The odc TrainingWorker's `_postprocess_output`: verl's, then the per-rank readings agreed on."""
    if kind != "training_worker":
        return
    current = require_attr(base, "_postprocess_output", NAME)
    found = parameters(current)
    if found != _PARAMS:
        raise PatchError(
            f"odc patch '{NAME}': TrainingWorker._postprocess_output({', '.join(found)}) is not ({', '.join(_PARAMS)})"
        )
    source = inspect.getsource(current)
    missing = [key for key in PER_RANK_MAX + PER_RANK_MEAN if f'"{key}"' not in source]
    if missing:
        raise PatchError(
            f"odc patch '{NAME}': _postprocess_output no longer reports {missing}; re-check which "
            f"of its metrics are per-rank readings"
        )

    @functools.wraps(current)
    def _postprocess_output(self, output, *, global_token_num, delta_time, forward_only, images_seqlens):
        from verl.utils import tensordict_utils as tu

        final = current(
            self,
            output,
            global_token_num=global_token_num,
            delta_time=delta_time,
            forward_only=forward_only,
            images_seqlens=images_seqlens,
        )
        group = self.engine.get_data_parallel_group()
        # an odc run's reference model may stay on fsdp2, in the same worker class
        if getattr(self.engine_config, "strategy", None) == "odc" and group is not None:
            metrics = dict(tu.get(final, "metrics"))
            _agree(metrics, group)
            tu.assign_non_tensor(final, metrics=metrics)
        return final

    members["_postprocess_output"] = _postprocess_output


def _agree(metrics: dict, group) -> None:
    import torch
    import torch.distributed as dist
    from verl.utils.device import get_device_id

    for keys, op, scale in ((PER_RANK_MAX, dist.ReduceOp.MAX, 1), (PER_RANK_MEAN, dist.ReduceOp.SUM, None)):
        present = [key for key in keys if key in metrics]
        if not present:
            continue
        values = torch.tensor([float(metrics[key]) for key in present], dtype=torch.float64, device=get_device_id())
        dist.all_reduce(values, op=op, group=group)
        values /= scale or dist.get_world_size(group)
        metrics.update(zip(present, values.cpu().tolist()))
