"""verl backend `odc` against verl's own `fsdp2` engine on 2 CPU gloo ranks (tests/verl/harness.py).

One 2-rank run builds, for each strategy, an actor, a forward-only reference model and a critic, and:
  * compares log-probs, reference log-probs and values, and under `odc` also on an uneven split (the
    share a forward-only LB-Mini plan gives each rank) against `fsdp2`'s even one, sample by sample;
  * updates the actor once: `fsdp2` with verl's even split, `odc` with an uneven split (3 vs 5
    samples, so the ranks run different micro-batch counts); the updates must agree;
  * updates the critic once through verl's own train_mini_batch, under both strategies;
  * compares the weights exported for the rollout, and loads a checkpoint saved under `odc` into
    `fsdp2` and one saved under `fsdp2` into `odc`.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.verl import harness as H

WORLD = 2
BATCH = 8
SEED = 0
MAX_TOKENS = H.SGD["max_token_len_per_gpu"]  # per-micro-batch budget: several micro-batches per rank
UNEVEN = [[0, 1, 2], [3, 4, 5, 6, 7]]


def _body(rank, world_size, model_dir, ckpt_dir):
    even = H.make_grpo_batch(SEED, BATCH, world_size=world_size, rank=rank)
    uneven = H.make_grpo_batch(SEED, BATCH, indices=UNEVEN[rank])
    out = {}
    for strategy in ("fsdp2", "odc"):
        res = out[strategy] = {}
        actor = H.build_engine("language_model", strategy, model_dir, **H.SGD)
        res["engine"] = type(actor.engine).__name__
        res["log_probs"] = H.compute_log_probs(actor, even)
        if strategy == "odc":
            res["uneven_log_probs"] = H.compute_log_probs(actor, uneven)
        res["exported_before"] = H.exported_weights(actor)
        calls = H.count_micro_batches(actor)
        if strategy == "odc":
            res["metrics"] = H.train_step(actor, uneven)
        else:
            res["metrics"] = H.actor_update(actor, even)
        res["micro_batches"] = len(calls)
        res["list_metrics"] = _pass_with_list_metrics(actor, even)
        res["actor_after"] = H.full_state_dict(actor)
        res["exported_after"] = H.exported_weights(actor)
        actor.engine.save_checkpoint(os.path.join(ckpt_dir, strategy), global_step=1)
        del actor

        ref = H.build_engine("language_model", strategy, model_dir, forward_only=True, max_token_len_per_gpu=MAX_TOKENS)
        res["ref_log_probs"] = H.compute_log_probs(ref, even)
        if strategy == "odc":
            res["uneven_ref_log_probs"] = H.compute_log_probs(ref, uneven)
        del ref

        critic = H.build_engine("value_model", strategy, model_dir, **H.SGD)
        res["values"] = H.compute_values(critic, even)
        if strategy == "odc":
            res["uneven_values"] = H.compute_values(critic, uneven)
        # the critic goes through verl's own train_mini_batch on verl's even split, under both strategies
        H.critic_update(critic, even)
        res["critic_after"] = H.full_state_dict(critic)
        del critic

    # Checkpoints cross over: each strategy loads the other's and must hold the other's weights.
    for strategy, other in (("fsdp2", "odc"), ("odc", "fsdp2")):
        actor = H.build_engine("language_model", strategy, model_dir, **H.SGD)
        actor.engine.load_checkpoint(os.path.join(ckpt_dir, other), del_local_after_load=False)
        out[strategy]["loaded_other"] = H.full_state_dict(actor)
        del actor
    return out


def _pass_with_list_metrics(worker, batch) -> str:
    """A forward pass with its loss whose post-processing hands its metrics back as a list, as a user's may:
    verl's engine returns them as they are; the type the engine returned (the worker, which reads a dict,
    gets them back as one)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp import transformer_impl

    import odc_plugin.verl.engine as odc_engine

    returned = []
    engine_infer = worker.engine.infer_batch

    def infer_batch(data, loss_function=None):
        out = engine_infer(data, loss_function=loss_function)
        returned.append(type(out["metrics"]).__name__)
        out["metrics"] = out["metrics"][0]
        return out

    def as_list(postprocess):
        return lambda **kw: {**(out := postprocess(**kw)), "metrics": [out["metrics"]]}

    saved = odc_engine.postprocess_batch_func, transformer_impl.postprocess_batch_func
    odc_engine.postprocess_batch_func, transformer_impl.postprocess_batch_func = map(as_list, saved)
    worker.engine.infer_batch = infer_batch
    try:
        data = batch.clone()
        tu.assign_non_tensor(data, compute_loss=True)
        worker.infer_batch(data)
    finally:
        odc_engine.postprocess_batch_func, transformer_impl.postprocess_batch_func = saved
        del worker.engine.infer_batch
    return returned[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    return H.run_on_ranks(_body, WORLD, model_dir, ckpt_dir, plugin_modules=H.PLUGIN)


def test_registry_gives_odc_engines(runs):
    assert runs[0]["odc"]["engine"] == "ODCEngineWithLMHead"
    assert runs[0]["fsdp2"]["engine"] == "FSDPEngineWithLMHead"


def test_a_post_processing_that_returns_a_list_of_metrics_passes_as_under_fsdp2(runs):
    assert [r[s]["list_metrics"] for r in runs for s in ("fsdp2", "odc")] == ["list"] * 4


def test_ranks_ran_different_micro_batch_counts_under_odc(runs):
    odc_counts = [r["odc"]["micro_batches"] for r in runs]
    fsdp_counts = [r["fsdp2"]["micro_batches"] for r in runs]
    assert odc_counts[0] != odc_counts[1], odc_counts
    assert fsdp_counts[0] == fsdp_counts[1], fsdp_counts


def test_actor_and_critic_updates_equal_fsdp2(runs):
    for r in runs:
        H.assert_state_close(r["odc"]["actor_after"], r["fsdp2"]["actor_after"], "actor")
        H.assert_state_close(r["odc"]["critic_after"], r["fsdp2"]["critic_after"], "critic")
    # the update really moved the weights
    before, after = runs[0]["fsdp2"]["exported_before"], runs[0]["fsdp2"]["exported_after"]
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_log_probs_ref_log_probs_and_values_equal_fsdp2(runs):
    for r in runs:
        for key in ("log_probs", "ref_log_probs", "values"):
            for got, expected in zip(r["odc"][key], r["fsdp2"][key], strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=key)


def test_forward_only_passes_on_uneven_shares_equal_fsdp2_sample_by_sample(runs):
    for key in ("log_probs", "ref_log_probs", "values"):
        expected = {
            i: t
            for rank, r in enumerate(runs)
            for i, t in zip(H.shard_for_rank(range(BATCH), rank, WORLD), r["fsdp2"][key], strict=True)
        }
        got = {
            i: t for rank, r in enumerate(runs) for i, t in zip(UNEVEN[rank], r["odc"][f"uneven_{key}"], strict=True)
        }
        assert sorted(got) == sorted(expected) == list(range(BATCH))
        # a log-prob sequence's last entry predicts whatever the packing put next (H.compute_log_probs)
        real = slice(None, -1) if key.endswith("log_probs") else slice(None)
        for i in range(BATCH):
            torch.testing.assert_close(got[i][real], expected[i][real], rtol=1e-5, atol=1e-6, msg=f"{key}, sample {i}")


def test_exported_weights_equal_fsdp2(runs):
    for key in ("exported_before", "exported_after"):
        H.assert_state_close(runs[0]["odc"][key], runs[0]["fsdp2"][key], key)


def test_checkpoints_load_across_strategies(runs):
    for r in runs:
        H.assert_state_close(r["fsdp2"]["loaded_other"], r["odc"]["actor_after"], "odc checkpoint in fsdp2")
        H.assert_state_close(r["odc"]["loaded_other"], r["fsdp2"]["actor_after"], "fsdp2 checkpoint in odc")


def test_odc_metrics_reach_the_worker_output(runs):
    metrics = runs[0]["odc"]["metrics"]
    for key in ("odc/compute_s_max", "odc/wait_s_max", "odc/compute_imbalance", "odc/micro_batches_max"):
        assert key in metrics, sorted(metrics)
    # the transport's calibration at the engine's start: its figures, alike on both ranks, and the one method chosen
    transport = {k: {float(x) for v in values for x in v} for k, values in metrics.items() if "/transport/" in k}
    assert all(len(v) == 1 for v in transport.values()), transport
    for key in ("odc/transport/ratio", "odc/transport/gather_ratio", "odc/transport/accumulate_ratio"):
        assert min(transport[key]) > 0, key
    chosen = [k for k, v in transport.items() if k.endswith("_chosen") and v == {1.0}]
    assert chosen in (["odc/transport/accumulate_direct_chosen"], ["odc/transport/accumulate_slots_chosen"])
