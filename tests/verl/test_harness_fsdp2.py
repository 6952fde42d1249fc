"""verl's stock fsdp2 engine on 2 CPU gloo ranks, through the harness (tests/verl/harness.py).

One 2-rank run (module fixture) builds an actor and a critic TrainingWorker and:
  * computes log-probs of the initial model (compared with a plain HF forward),
  * does one actor update with the even split verl's dispatch gives (train_mini_batch),
  * does the same update on a second actor with an uneven per-rank split (train_batch),
  * computes values and does one critic update.
A 1-rank run on the whole batch gives the reference update.
"""

from __future__ import annotations

import pytest
import torch

from tests.verl import harness as H

WORLD = 2
BATCH = 8
SEED = 0
MAX_TOKENS = 64  # per-rank dynamic-bsz budget: several micro-batches per rank (longest sample is 52 tokens)
UNEVEN = [[0, 1, 2], [3, 4, 5, 6, 7]]  # rank 0 gets 3 samples, rank 1 gets 5
# Plain SGD for the actor so parameter deltas are -lr * grad: a first AdamW step is ~lr * sign(grad)
# and would hide any error in the loss scale. (The critic keeps verl's default AdamW.)
ACTOR = {"max_token_len_per_gpu": MAX_TOKENS, "lr": 1.0, "optim_kwargs": {"optimizer": "SGD", "weight_decay": 0.0}}


def _two_rank_body(rank, world_size, model_dir):
    out = {}
    # -- actor: log-probs, then one update with verl's even split -----------------------------
    actor = H.build_engine("language_model", "fsdp2", model_dir, **ACTOR)
    batch = H.make_grpo_batch(SEED, BATCH, world_size=world_size, rank=rank)
    out["indices"] = H.shard_for_rank(range(BATCH), rank, world_size)
    out["log_probs"] = H.compute_log_probs(actor, batch)
    out["before"] = H.full_state_dict(actor)
    calls = H.count_micro_batches(actor)
    out["actor_metrics"] = H.actor_update(actor, batch)
    out["micro_batches"] = list(calls)
    out["after_even"] = H.full_state_dict(actor)
    out["exported"] = H.exported_weights(actor)
    del actor

    # -- actor: same step, uneven split (what an LB-Mini share looks like to the engine) -------
    actor2 = H.build_engine("language_model", "fsdp2", model_dir, **ACTOR)
    uneven = H.make_grpo_batch(SEED, BATCH, indices=UNEVEN[rank])
    out["uneven_metrics"] = H.train_step(actor2, uneven)
    out["after_uneven"] = H.full_state_dict(actor2)
    del actor2

    # -- critic: values, one update ------------------------------------------------------------
    critic = H.build_engine("value_model", "fsdp2", model_dir, max_token_len_per_gpu=MAX_TOKENS)
    out["values"] = H.compute_values(critic, batch)
    c_before = H.full_state_dict(critic)
    out["critic_metrics"] = H.critic_update(critic, batch)
    c_after = H.full_state_dict(critic)
    out["critic_delta"] = max((c_after[k] - c_before[k]).abs().max().item() for k in c_before)
    out["critic_state"] = c_after
    return out


def _one_rank_body(rank, world_size, model_dir):
    actor = H.build_engine("language_model", "fsdp2", model_dir, **ACTOR)
    batch = H.make_grpo_batch(SEED, BATCH, world_size=world_size, rank=rank)
    before = H.full_state_dict(actor)
    metrics = H.actor_update(actor, batch)
    return {"before": before, "after": H.full_state_dict(actor), "metrics": metrics}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.make_tiny_qwen2(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def two_rank(model_dir):
    return H.run_on_ranks(_two_rank_body, WORLD, model_dir)


@pytest.fixture(scope="module")
def one_rank(model_dir):
    return H.run_on_ranks(_one_rank_body, 1, model_dir)[0]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def _rel_diff(d1: dict, d2: dict) -> float:
    """max |d1 - d2| / max |d1| over all parameters."""
    return _max_diff(d1, d2) / max(v.abs().max().item() for v in d1.values())


def test_actor_update_changes_parameters(two_rank):
    r0, r1 = two_rank
    assert _max_diff(r0["before"], r0["after_even"]) > 1e-4
    # full parameters are identical on both ranks after the step
    assert _max_diff(r0["after_even"], r1["after_even"]) == 0.0
    m = r0["actor_metrics"]
    for key in ("actor/pg_loss", "loss", "grad_norm", "lr"):
        assert key in m, key
    assert m["grad_norm"][0] > 0


def test_dynamic_bsz_makes_several_micro_batches(two_rank):
    counts = [r["micro_batches"] for r in two_rank]
    # same number of micro-batches on every rank (verl syncs the count), more than one each
    assert len(counts[0]) == len(counts[1]) >= 2, counts
    assert [sum(c) for c in counts] == [BATCH // WORLD] * WORLD


def test_log_probs_match_plain_hf_forward(two_rank, model_dir):
    samples = H.make_grpo_samples(SEED, BATCH)
    hf = H.hf_log_probs(H.load_hf_model(model_dir), samples)
    checked = 0
    for r in two_rank:
        for local, i in enumerate(r["indices"]):
            ours = r["log_probs"][local]
            n = samples[i]["input_ids"].numel()
            assert ours.shape == (n,)
            torch.testing.assert_close(ours[: n - 1], hf[i], atol=1e-5, rtol=0)
            checked += 1
    assert checked == BATCH


def test_two_rank_update_equals_one_rank_update(two_rank, one_rank):
    # global token-mean normalisation: the update does not depend on the DP split
    r0 = two_rank[0]
    assert _max_diff(r0["before"], one_rank["before"]) == 0.0
    d2, d1 = _delta(r0["before"], r0["after_even"]), _delta(one_rank["before"], one_rank["after"])
    assert _rel_diff(d1, d2) < 1e-5
    torch.testing.assert_close(
        r0["actor_metrics"]["grad_norm"][0], one_rank["metrics"]["grad_norm"][0], rtol=1e-5, atol=0
    )


def test_uneven_split_gives_the_same_update(two_rank):
    r0, r1 = two_rank
    d_even, d_uneven = _delta(r0["before"], r0["after_even"]), _delta(r0["before"], r0["after_uneven"])
    assert _rel_diff(d_even, d_uneven) < 1e-5
    assert _max_diff(r0["after_uneven"], r1["after_uneven"]) == 0.0
    torch.testing.assert_close(
        r0["uneven_metrics"]["grad_norm"], r0["actor_metrics"]["grad_norm"][0], rtol=1e-5, atol=0
    )


def test_exported_weights_are_hf_named_full_tensors(two_rank, model_dir):
    ref = H.load_hf_model(model_dir).state_dict()
    exported = two_rank[0]["exported"]
    assert set(exported) <= set(ref)
    for k, v in exported.items():
        assert v.shape == ref[k].shape, k
    after = two_rank[0]["after_even"]
    torch.testing.assert_close(exported["model.norm.weight"], after["model.norm.weight"])


def test_critic_update_runs(two_rank):
    r0, r1 = two_rank
    assert r0["critic_delta"] > 1e-4
    assert _max_diff(r0["critic_state"], r1["critic_state"]) == 0.0
    assert "critic/vf_loss" in r0["critic_metrics"]
    samples = H.make_grpo_samples(SEED, BATCH)
    for r in two_rank:
        for local, i in enumerate(r["indices"]):
            assert r["values"][local].shape == (samples[i]["input_ids"].numel(),)
