"""The `auto` cost's fit reaches the trainer as the update's latest fit, not a mean of fits.

The odc engine refits after every mini-batch. verl's trainer reduces each metric of an update over its
mini-batches by the mean, so fit coefficients reported for every mini-batch would plan the next step
with an average of fits that no timing supports. The engine reports the fit after the update's last
mini-batch only; verl's train_mini_batch on 2 CPU gloo ranks, 3 mini-batches (tests/verl/harness.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.verl import harness as H

WORLD, BATCH, MINI = 2, 24, 8
MAX_TOKENS = 48  # a sample or two per micro-batch: several timings per rank and mini-batch


def _body(rank, world_size, model_dir):
    from verl.utils.metric import reduce_metrics

    batch = H.make_grpo_batch(0, BATCH, world_size=world_size, rank=rank, mini_batch_size=MINI)
    actor = H.build_engine("language_model", "odc", model_dir, max_token_len_per_gpu=MAX_TOKENS)
    fits = []
    refit = actor.engine._refit

    def recording_refit(timings):
        out = refit(timings)
        fits.append(actor.engine.odc_time_fit.fit)
        return out

    actor.engine._refit = recording_refit
    metrics = H.actor_update(actor, batch)
    reported = reduce_metrics({k: v for k, v in metrics.items() if k.startswith(("odc/fit_", "odc/rank_speed_"))})
    return {"reported": reported, "fits": [f and dataclasses.asdict(f) for f in fits]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    return H.run_on_ranks(_body, WORLD, model_dir, plugin_modules=H.PLUGIN)


def test_the_trainer_gets_the_fit_after_the_last_mini_batch(runs):
    for run in runs:
        fits, reported = run["fits"], run["reported"]
        assert len(fits) == BATCH // MINI and fits[-2] is not None and fits[-1] != fits[-2]  # a fit per mini-batch
        last = fits[-1]
        for key in ("a", "b", "c"):
            assert reported[f"odc/fit_{key}"] == pytest.approx(last[key], rel=1e-12), key
        assert reported["odc/fit_timings"] == last["timings"]
        assert [reported[f"odc/rank_speed_{r}"] for r in range(WORLD)] == pytest.approx(last["speeds"], rel=1e-12)
