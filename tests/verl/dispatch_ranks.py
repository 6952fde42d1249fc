"""Rank bodies for tests/verl/test_lb_mini_dispatch.py (module-level so the harness can import them)."""

from __future__ import annotations

from odc_plugin.verl.dispatch import COUNTS_KEY
from tests.verl import harness as H

# SGD keeps parameter deltas proportional to the gradient, so a wrong share of the loss shows.
SGD = {"lr": 0.1, "optim_kwargs": {"optimizer": "SGD", "weight_decay": 0.0}}


def _record_steps(worker) -> list[tuple[int, bool]]:
    """(samples, steps the lr scheduler) of every train_batch call, i.e. of every optimizer step."""
    from verl.utils import tensordict_utils as tu

    steps = []
    original = worker.train_batch

    def train_batch(data):
        steps.append((len(data), bool(tu.get(data, key="update_lr_scheduler", default=False))))
        return original(data)

    worker.train_batch = train_batch
    return steps


def uneven_vs_even_update(
    rank,
    world_size,
    model_dir,
    seed,
    batch_size,
    mini_batch_size,
    max_tokens,
    odc_positions,
    odc_counts,
    even_positions,
):
    """One update_actor on the same global mini-batches, two ways.

    odc:   strategy odc, this rank's LB-Mini share (odc_positions[rank], counts per mini-batch as the dispatch
           sends them in extra_info), through the patched TrainingWorker.train_mini_batch;
    fsdp2: stock verl, an equal share per mini-batch laid out so that verl's own slicing forms the same
           global mini-batches (even_positions[rank]), through the same method with no counts (stock path).
    """
    from verl.utils import tensordict_utils as tu

    out = {}
    for strategy in ("odc", "fsdp2"):
        worker = H.build_engine("language_model", strategy, model_dir, max_token_len_per_gpu=max_tokens, **SGD)
        positions = odc_positions[rank] if strategy == "odc" else even_positions[rank]
        batch = H.make_grpo_batch(seed, batch_size, indices=positions, mini_batch_size=mini_batch_size)
        if strategy == "odc":
            # what tqbridge makes of the extra_info entry on the worker (_async_meta_to_realdata)
            tu.assign_non_tensor_data(batch, COUNTS_KEY, list(odc_counts[rank]))
        steps = _record_steps(worker)
        micro = H.count_micro_batches(worker)
        metrics = H.actor_update(worker, batch)
        out[strategy] = {
            "engine": type(worker.engine).__name__,
            "steps": steps,
            "micro_batches": len(micro),
            "metrics": metrics,
            "state": H.full_state_dict(worker),
        }
        del worker
    return out
