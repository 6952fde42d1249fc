"""Rank bodies for tests/verl/test_lb_mini_dispatch.py (module-level so the harness can import them)."""

from __future__ import annotations

from odc_plugin.verl.dispatch import STEPS_KEY
from tests.verl import harness as H

# SGD keeps parameter deltas proportional to the gradient, so a wrong share of the loss shows.
SGD = {"lr": 0.1, "optim_kwargs": {"optimizer": "SGD", "weight_decay": 0.0}}


def _record_steps(worker) -> list[tuple[list[tuple[int, ...]], bool]]:
    """(the samples, whether the lr scheduler steps) of every train_batch call, i.e. of every optimizer
    step; a sample is named by its token ids."""
    from verl.utils import tensordict_utils as tu

    steps = []
    original = worker.train_batch

    def train_batch(data):
        samples = [tuple(ids.tolist()) for ids in data["input_ids"].unbind()]
        steps.append((samples, bool(tu.get(data, key="update_lr_scheduler", default=False))))
        return original(data)

    worker.train_batch = train_batch
    return steps


def odc_vs_stock_update(
    rank,
    world_size,
    model_dir,
    seed,
    batch_size,
    batch_kwargs,
    odc_positions,
    odc_steps,
):
    """One update_actor on the same batch, two ways.

    fsdp2: stock verl: this rank's chunk of the batch (what verl's dispatch hands it), cut into mini-batches
           by verl's own train_mini_batch (its iterator, epochs, shuffle);
    odc:   strategy odc, this rank's samples of the LB-Mini plan (odc_positions[rank]) and its steps
           (odc_steps[rank], as the dispatch sends them in extra_info), through the odc
           TrainingWorker.train_mini_batch.
    """
    from verl.utils import tensordict_utils as tu

    out = {}
    for strategy in ("odc", "fsdp2"):
        if "max_token_len_per_gpu" in batch_kwargs:
            engine_kwargs = {"max_token_len_per_gpu": batch_kwargs["max_token_len_per_gpu"]}
        else:
            engine_kwargs = {
                "use_dynamic_bsz": False,
                "micro_batch_size_per_gpu": batch_kwargs["micro_batch_size_per_gpu"],
            }
        worker = H.build_engine("language_model", strategy, model_dir, **engine_kwargs, **SGD)
        if strategy == "odc":
            batch = H.make_grpo_batch(seed, batch_size, indices=odc_positions[rank], **batch_kwargs)
            # what tqbridge makes of the extra_info entry on the worker (_async_meta_to_realdata)
            tu.assign_non_tensor_data(batch, STEPS_KEY, odc_steps[rank])
        else:
            batch = H.make_grpo_batch(seed, batch_size, world_size=world_size, rank=rank, **batch_kwargs)
        steps = _record_steps(worker)
        micro = H.count_micro_batches(worker)
        metrics = H.actor_update(worker, batch)
        out[strategy] = {
            "engine": type(worker.engine).__name__,
            "steps": steps,
            "micro_batches": micro,
            "metrics": metrics,
            "state": H.full_state_dict(worker),
        }
        del worker
    return out
