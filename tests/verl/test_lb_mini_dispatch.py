"""LB-Mini dispatch from the rollout batch to per-rank mini-batch shares (odc_plugin/verl/dispatch.py and
the patches patches/lb_mini_dispatch.py, patches/lb_mini_worker.py).

* the plan: membership of mini-batches as verl forms them, every sample once, uneven counts, at least one
  sample per rank, groups, errors, determinism;
* the split of a batch's TransferQueue metadata by a plan, and the per-rank step order;
* the settings a role gets from its engine config (which runs are ODC + LB-Mini);
* verl's v1 PPOTrainer with the patch (real `_balance_batch` / `_update_actor` / `_update_critic` on a
  real hydra config; the worker groups are stand-ins, since Ray workers and TransferQueue cannot run here);
* the patched dispatch inside verl's real `dispatch_nd_compute` (Ray object store, stand-in worker group);
* the patched `TrainingWorker.train_mini_batch` on 2 gloo ranks with the `odc` engine and uneven shares,
  against stock fsdp2 on an even split of the same global mini-batches.
"""

from __future__ import annotations

import importlib.util
import random
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_plugin.verl.dispatch import (
    COUNTS_KEY,
    PLAN_KEY,
    MiniBatchPlan,
    _fill_empty_ranks,
    lb_mini_settings,
    mini_batch_schedule,
    plan_metrics,
    plan_mini_batches,
    plan_payload,
    split_by_plan,
)
from tests.verl import harness as H
from tests.verl.dispatch_ranks import uneven_vs_even_update

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None
needs_tq = pytest.mark.skipif(
    not HAS_TQ,
    reason="verl's v1 trainer and KVBatchMeta need the TransferQueue package (pip install TransferQueue==0.1.10)",
)


def _check_plan(plan: MiniBatchPlan, n: int, mini: int, dp: int):
    assert sorted(plan.order) == list(range(n))  # every sample exactly once
    assert plan.dp_size == dp and plan.num_mini_batches == n // mini
    for i, mb in enumerate(plan.shares()):
        # mini-batch i is the i-th consecutive slice of the batch, as verl forms them in its order
        assert sorted(p for share in mb for p in share) == list(range(i * mini, (i + 1) * mini))
        assert all(len(share) >= 1 for share in mb)
    for r in range(dp):
        assert sum(plan.counts[r]) == len(plan.rank_positions(r))


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 4),
    per_rank=st.integers(1, 4),
    num_mini=st.integers(1, 3),
    data=st.data(),
)
def test_plan_covers_every_mini_batch_once_with_a_sample_per_rank(dp, per_rank, num_mini, data):
    mini = dp * per_rank
    lens = data.draw(st.lists(st.integers(1, 96), min_size=mini * num_mini, max_size=mini * num_mini))
    plan = plan_mini_batches(lens, mini, dp, 96, "tokens")
    _check_plan(plan, len(lens), mini, dp)
    assert plan == plan_mini_batches(list(lens), mini, dp, 96, "tokens")  # deterministic


def test_plan_counts_may_differ_and_beat_the_equal_split():
    # one long sequence per mini-batch: the equal split puts it with as many samples as the others get
    lens = [60, 8, 8, 8, 8, 8, 8, 8] * 2
    plan = plan_mini_batches(lens, 8, 2, 64, "tokens")
    _check_plan(plan, 16, 8, 2)
    assert all(sorted(c) == [1, 7] for c in zip(*plan.counts))  # the 60-token sample alone, 7 short ones
    for mb in plan.shares():
        # busiest rank: 60 tokens; an equal split (4 + 4) puts 60 + 3 * 8 = 84 on one rank
        assert max(sum(lens[p] for p in share) for share in mb) == 60
    metrics = plan_metrics(plan, lens, "tokens", "odc_balance")
    assert metrics["odc_balance/samples_min"] < metrics["odc_balance/samples_max"]
    assert metrics["odc_balance/efficiency"] == pytest.approx(1.0)
    assert metrics["odc_balance/mini_batches"] == 2


def test_plan_keeps_groups_and_never_leaves_a_rank_empty():
    rng = random.Random(1)
    lens = [rng.randint(5, 60) for _ in range(12)]
    groups = [i // 3 for i in range(12)]  # GRPO: 3 responses per prompt, 2 groups per mini-batch
    plan = plan_mini_batches(lens, 6, 2, 64, "tokens", group_ids=groups)
    _check_plan(plan, 12, 6, 2)
    for r in range(2):
        mine = set(plan.rank_positions(r))
        assert all(set(range(g * 3, g * 3 + 3)) <= mine or not set(range(g * 3, g * 3 + 3)) & mine for g in range(4))
    # a single group per mini-batch would leave a rank empty: its cheapest sample moves there
    plan = plan_mini_batches(lens, 6, 2, 64, "tokens", group_ids=[i // 6 for i in range(12)])
    _check_plan(plan, 12, 6, 2)
    assert sorted(c for mb in zip(*plan.counts) for c in mb) == [1, 1, 5, 5]
    for mb in plan.shares():
        moved = min(mb, key=len)[0]
        assert lens[moved] == min(lens[p] for share in mb for p in share)


def test_fill_empty_ranks_takes_the_cheapest_sample_of_the_fullest_rank():
    shares = [[0, 1, 2], [], [3, 4], []]
    _fill_empty_ranks(shares, [5.0, 1.0, 3.0, 0.5, 9.0])
    # rank 0 (3 samples) gives its cheapest (1); then ranks 0 and 2 tie at 2 and the lower rank gives
    assert shares == [[0], [1], [3, 4], [2]]


def test_plan_static_micro_batch_size_and_flops_cost():
    lens = [10, 200, 30, 40, 50, 60]
    model = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    from odc_plugin.balance import get_cost_model

    plan = plan_mini_batches(lens, 6, 2, None, get_cost_model("flops", model=model), micro_batch_size=2)
    _check_plan(plan, 6, 6, 2)
    for r in range(2):
        assert plan.micro_batches[r][0] == -(-plan.counts[r][0] // 2)


@pytest.mark.parametrize(
    ("lens", "mini", "dp", "max_tokens", "match"),
    [
        ([10] * 6, 4, 2, 64, "whole mini-batches"),
        ([10] * 6, 2, 3, 64, "cannot give each of 3"),
        ([10, 80, 10, 10], 4, 2, 64, "more than the per-micro-batch budget"),
        ([10] * 4, 4, 2, None, "give max_token_len"),
    ],
)
def test_plan_errors(lens, mini, dp, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        plan_mini_batches(lens, mini, dp, max_tokens, "tokens")


def test_mini_batch_schedule():
    assert mini_batch_schedule(3, 2, seed=7, shuffle=False) == [0, 1, 2, 0, 1, 2]
    shuffled = mini_batch_schedule(5, 3, seed=7, shuffle=True)
    assert shuffled == mini_batch_schedule(5, 3, seed=7, shuffle=True)  # the same on every rank
    assert all(sorted(shuffled[e * 5 : e * 5 + 5]) == list(range(5)) for e in range(3))


# ---------------------------------------------------------------------------------------------
# which roles use LB-Mini
# ---------------------------------------------------------------------------------------------


def _engine_config(strategy, **odc):
    from verl.workers.config import FSDPEngineConfig

    from odc_plugin.verl.config import ODCEngineConfig

    if odc:
        return ODCEngineConfig(**odc)
    cfg = FSDPEngineConfig(strategy="fsdp2")
    object.__setattr__(cfg, "strategy", strategy)  # as FSDPActorConfig.__post_init__ does
    return cfg


def test_settings_only_for_odc_with_lb_mini():
    kw = {"mini_batch_size": 8, "use_dynamic_bsz": True, "max_token_len": 64, "micro_batch_size": None}
    assert lb_mini_settings(_engine_config("fsdp2"), **kw) is None
    assert lb_mini_settings(_engine_config("fsdp"), **kw) is None
    assert lb_mini_settings(_engine_config("odc", odc_balancer="lb_micro"), **kw) is None
    # a plain FSDP engine config carrying strategy odc gets ODC's defaults: lb_mini with the flops cost
    loaded = []
    model = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    s = lb_mini_settings(_engine_config("odc"), **kw, model_config=lambda: loaded.append(1) or model)
    assert s.cost.name == "flops" and loaded == [1] and (s.max_token_len, s.micro_batch_size) == (64, None)
    s = lb_mini_settings(
        _engine_config("odc", odc_cost_model="fit", odc_cost_fit_a=2.0, odc_cost_fit_b=3.0),
        **{**kw, "use_dynamic_bsz": False, "micro_batch_size": 4},
    )
    assert s.cost(10) == 2.0 * 100 + 3.0 * 10 and (s.max_token_len, s.micro_batch_size) == (None, 4)


# ---------------------------------------------------------------------------------------------
# splitting a batch's metadata
# ---------------------------------------------------------------------------------------------


def _kv_batch(lens, **extra):
    from transfer_queue import KVBatchMeta

    keys = [f"uid{i}_0_0" for i in range(len(lens))]
    return KVBatchMeta(
        keys=keys,
        tags=[{"seq_len": s, "i": i} for i, s in enumerate(lens)],
        partition_id="train",
        fields=["input_ids"],
        extra_info=dict(extra),
    )


@needs_tq
def test_split_by_plan_gives_each_rank_its_keys_and_counts():
    lens = [60, 8, 8, 8, 30, 30, 30, 4]
    batch = _kv_batch(lens, temperature=1.0, mini_batch_size=4)
    plan = plan_mini_batches(lens, 4, 2, 64, "tokens")
    batch.extra_info[PLAN_KEY] = plan_payload(plan, batch.keys)
    pieces = split_by_plan(batch, 2)
    for r, piece in enumerate(pieces):
        assert [t["i"] for t in piece.tags] == plan.rank_positions(r)
        assert piece.keys == [batch.keys[p] for p in plan.rank_positions(r)]
        assert piece.extra_info == {"temperature": 1.0, "mini_batch_size": 4, COUNTS_KEY: list(plan.counts[r])}
        assert piece.partition_id == "train" and piece.fields == ["input_ids"]
    assert PLAN_KEY in batch.extra_info  # the caller's batch is left alone

    with pytest.raises(ValueError, match="for 2 ranks, the worker group has 4"):
        split_by_plan(batch, 4)
    batch.extra_info["mini_batch_size"] = 8
    with pytest.raises(ValueError, match="asks for 8"):
        split_by_plan(batch, 2)
    other = _kv_batch(lens[:4] + [1, 1, 1, 1], mini_batch_size=4)
    other.keys[-1] = "someone_else"
    other.extra_info[PLAN_KEY] = plan_payload(plan, batch.keys)
    with pytest.raises(ValueError, match="batch changed"):
        split_by_plan(other, 2)


# ---------------------------------------------------------------------------------------------
# verl's v1 trainer, patched
# ---------------------------------------------------------------------------------------------


class _WorkerGroup:
    """Stand-in for the actor / critic RayWorkerGroup: records what the patched dispatch would send."""

    def __init__(self, mesh):
        self._dispatch_info = {mesh: [0, 1]}
        self.sent = []
        self.reports = {}  # further metrics the engines report (e.g. the auto cost's fit)

    def _receive(self, batch):
        self.sent.append((dict(batch.extra_info), split_by_plan(batch, 2) if PLAN_KEY in batch.extra_info else None))
        return {"metrics": {"mfu": [0.5], "loss": [1.0], **self.reports}}

    def update_actor(self, batch):
        return self._receive(batch)

    def train_mini_batch(self, batch):
        return types.SimpleNamespace(get=lambda: self._receive(batch))


def _trainer(tmp_path, *overrides):
    import verl
    from hydra import compose, initialize_config_dir
    from transformers import Qwen2Config
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    import odc_patches

    odc_patches.apply_all()
    Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(tmp_path)
    base = [
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=3",
        f"actor_rollout_ref.model.path={tmp_path}",
        "+actor_rollout_ref.model.load_tokenizer=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # 6 samples per actor mini-batch
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
        "critic.enable=True",
        "critic.ppo_mini_batch_size=4",  # 12 samples per critic mini-batch
        f"critic.model.path={tmp_path}",
        "+critic.model.load_tokenizer=False",
        "+critic.ppo_infer_max_token_len_per_gpu=128",
    ]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=base + list(overrides))
    trainer = object.__new__(get_trainer_cls("sync"))  # the real class; __init__ would start Ray and TransferQueue
    trainer.config = config
    trainer.global_steps = 1
    trainer.use_critic = True
    trainer.use_reference_policy = False
    trainer.ref_in_actor = False
    trainer.tokenizer = types.SimpleNamespace(eos_token_id=2)
    trainer.actor_rollout_wg = _WorkerGroup("actor")
    trainer.critic_wg = _WorkerGroup("train")
    return trainer


LENS = [60, 8, 8, 8, 8, 8, 40, 30, 20, 10, 5, 5]  # 12 samples: 2 actor mini-batches, 1 critic mini-batch


@needs_tq
def test_trainer_plans_lb_mini_updates_for_odc(tmp_path):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = _trainer(tmp_path, "actor_rollout_ref.actor.strategy=odc", "critic.strategy=odc")
    batch = _kv_batch(LENS)
    arrival = list(batch.keys)  # verl reorders the batch in place
    metrics = {}
    balanced = trainer._balance_batch(batch, metrics=metrics)

    # verl's own balancing still ran: its order (kept by the inference stages) and its metrics
    stock_metrics = {}
    stock = PPOTrainer._balance_batch.__wrapped__(trainer, _kv_batch(LENS), metrics=stock_metrics)
    assert balanced.keys == stock.keys and {k: metrics[k] for k in stock_metrics} == stock_metrics

    plans = {stage: payload for stage, (payload, _) in trainer._odc_lb_mini_plans.items()}  # the stages consume them
    # the forward-only passes too: the whole batch as one mini-batch, a sample or more on every rank
    assert set(plans) == {"actor", "critic", "old_log_prob", "values"}
    for stage in ("old_log_prob", "values"):
        assert plans[stage]["mini_batch_size"] == len(LENS) and min(min(c) for c in plans[stage]["counts"]) >= 1
        assert sorted(k for keys in plans[stage]["keys"] for k in keys) == sorted(arrival)
    for role, mini in (("actor", 6), ("critic", 12)):
        payload = plans[role]
        assert payload["mini_batch_size"] == mini
        seen = []
        for i in range(len(LENS) // mini):  # mini-batch i = the i-th slice of the batch as it arrived
            members = []
            for keys, counts in zip(payload["keys"], payload["counts"]):
                start = sum(counts[:i])
                members += keys[start : start + counts[i]]
            assert sorted(members) == sorted(arrival[i * mini : (i + 1) * mini])
            seen += members
        assert sorted(seen) == sorted(arrival)
    assert plans["actor"]["counts"] != [[3, 3], [3, 3]]  # uneven: the 60-token sample sits nearly alone
    for key in ("min", "max", "efficiency", "samples_min", "samples_max", "micro_batches_min", "micro_batches_max"):
        assert f"odc_balance/{key}" in metrics and f"odc_balance/critic/{key}" in metrics
    assert metrics["odc_balance/samples_min"] < metrics["odc_balance/samples_max"]

    # the updates carry the plan to the dispatch, and only for the duration of the call
    trainer._update_critic(balanced, metrics)
    trainer._update_actor(balanced, metrics)
    for wg, role in ((trainer.critic_wg, "critic"), (trainer.actor_rollout_wg, "actor")):
        ((extra, pieces),) = wg.sent
        assert extra[PLAN_KEY] == plans[role] and extra["mini_batch_size"] == plans[role]["mini_batch_size"]
        assert [p.extra_info[COUNTS_KEY] for p in pieces] == plans[role]["counts"]
        assert [p.keys for p in pieces] == plans[role]["keys"]
    assert PLAN_KEY not in balanced.extra_info and set(trainer._odc_lb_mini_plans) == {"old_log_prob", "values"}
    assert metrics["perf/mfu/actor"] == 0.5 and metrics["perf/mfu/critic"] == 0.5


AUTO = [
    "actor_rollout_ref.actor.strategy=odc",
    "actor_rollout_ref.actor.fsdp_config._target_=odc_plugin.verl.config.ODCEngineConfig",
    "actor_rollout_ref.actor.fsdp_config.strategy=odc",
    "+actor_rollout_ref.actor.fsdp_config.odc_cost_model=auto",
    "critic.strategy=fsdp2",
]


@needs_tq
def test_auto_cost_plans_as_flops_until_the_engine_reports_a_fit_then_follows_it(tmp_path):
    trainer = _trainer(tmp_path, *AUTO)
    balanced = trainer._balance_batch(_kv_batch(LENS), metrics={})
    first, predicted = trainer._odc_lb_mini_plans["actor"]
    flops = _trainer(tmp_path / "flops", "actor_rollout_ref.actor.strategy=odc", "critic.strategy=fsdp2")
    flops._balance_batch(_kv_batch(LENS), metrics={})
    assert first == flops._odc_lb_mini_plans["actor"][0] and not predicted  # no timings yet: the flops plan

    # the actor's engine reports a fit in which rank 1 runs at half speed
    trainer.actor_rollout_wg.reports = {
        "odc/fit_c": [0.01],
        "odc/fit_a": [0.0],
        "odc/fit_b": [1e-3],
        "odc/fit_timings": [40.0],
        "odc/rank_speed_0": [1.0],
        "odc/rank_speed_1": [0.5],
        "odc/compute_s_max": [0.1],
    }
    metrics = {}
    trainer._update_actor(balanced, metrics)
    assert (metrics["odc_balance/fit_c"], metrics["odc_balance/fit_b"]) == (0.01, 1e-3)
    assert (metrics["odc_balance/rank_speed_min"], metrics["odc_balance/rank_speed_max"]) == (0.5, 1.0)

    trainer._balance_batch(_kv_batch(LENS), metrics={})
    plan, predicted = trainer._odc_lb_mini_plans["actor"]
    tokens = {k: s for k, s in zip(_kv_batch(LENS).keys, LENS)}
    per_rank = [sum(tokens[k] for k in keys) for keys in plan["keys"]]
    assert per_rank[1] < per_rank[0]  # the slow rank gets less
    assert len(predicted) == 2 and all(p > 0 for p in predicted)
    trainer._update_actor(balanced, metrics)
    assert metrics["odc_balance/prediction_error"] == pytest.approx(sum(predicted) / 2 / 0.1 - 1)


@needs_tq
@pytest.mark.parametrize(
    "overrides",
    [
        ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2"],
        [  # odc balanced by verl's equal split
            "actor_rollout_ref.actor.strategy=odc",
            "actor_rollout_ref.actor.fsdp_config._target_=odc_plugin.verl.config.ODCEngineConfig",
            "actor_rollout_ref.actor.fsdp_config.strategy=odc",
            "+actor_rollout_ref.actor.fsdp_config.odc_balancer=lb_micro",
            "critic.strategy=fsdp2",
        ],
    ],
    ids=["fsdp2", "odc-lb_micro"],
)
def test_trainer_unchanged_without_lb_mini(tmp_path, overrides):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = _trainer(tmp_path, *overrides)
    metrics, stock_metrics = {}, {}
    balanced = trainer._balance_batch(_kv_batch(LENS), metrics=metrics)
    stock = PPOTrainer._balance_batch.__wrapped__(trainer, _kv_batch(LENS), metrics=stock_metrics)
    assert balanced.keys == stock.keys and metrics == stock_metrics
    assert trainer._odc_lb_mini_plans == {}
    trainer._update_actor(balanced, metrics)
    ((extra, pieces),) = trainer.actor_rollout_wg.sent
    assert PLAN_KEY not in extra and pieces is None


# ---------------------------------------------------------------------------------------------
# the dispatch inside verl's dispatch machinery
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@needs_tq
def test_dispatch_sends_each_rank_its_share(ray_local):
    from tensordict import TensorDict
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.single_controller.base.worker_group import WorkerGroup
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    import odc_patches

    odc_patches.apply_all()
    # 4 workers, data-parallel ranks [0, 0, 1, 1] (e.g. 2-way model parallel): workers 0,1 get rank 0's share
    wg = object.__new__(WorkerGroup)
    wg._workers = [None] * 4
    wg._dispatch_info = {"actor": [0, 0, 1, 1], "train": [0, 0, 1, 1]}
    lens = [60, 8, 8, 8, 30, 30, 30, 4]
    plan = plan_mini_batches(lens, 4, 2, 64, "tokens")
    for method in (ActorRolloutRefWorker.update_actor, TrainingWorker.train_mini_batch):
        dispatch = getattr(method, MAGIC_ATTR)["dispatch_mode"]["dispatch_fn"]
        batch = _kv_batch(lens, mini_batch_size=4)
        batch.extra_info[PLAN_KEY] = plan_payload(plan, batch.keys)
        args, kwargs = dispatch(wg, batch)
        sent = ray_local.get(list(args[0]))
        assert not kwargs and len(sent) == 4
        for worker, dp_rank in enumerate([0, 0, 1, 1]):
            assert sent[worker].keys == [batch.keys[p] for p in plan.rank_positions(dp_rank)]
            assert sent[worker].extra_info[COUNTS_KEY] == list(plan.counts[dp_rank])
            assert PLAN_KEY not in sent[worker].extra_info
        # without a plan verl's own dispatch runs: equal chunks (a TensorDict needs no TransferQueue)
        td = TensorDict({"x": torch.arange(8)}, batch_size=[8])
        args, _ = dispatch(wg, td)
        assert [ray_local.get(a)["x"].tolist() for a in args[0]] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2


# ---------------------------------------------------------------------------------------------
# the patched train_mini_batch on 2 ranks, for real
# ---------------------------------------------------------------------------------------------

SEED, BATCH, MINI, MAX_TOKENS = 3, 12, 6, 64  # seed 3: LB-Mini splits both mini-batches 4 / 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    lens = [len(s["input_ids"]) for s in H.make_grpo_samples(SEED, BATCH)]
    plan = plan_mini_batches(lens, MINI, 2, MAX_TOKENS, "tokens")
    odc_positions = [plan.rank_positions(r) for r in range(2)]
    # stock: rank r holds the r-th half of every mini-batch, so verl's slicing forms the same mini-batches
    half = MINI // 2
    even = [[p for i in range(0, BATCH, MINI) for p in range(i + r * half, i + (r + 1) * half)] for r in range(2)]
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    results = H.run_on_ranks(
        uneven_vs_even_update,
        2,
        model_dir,
        SEED,
        BATCH,
        MINI,
        MAX_TOKENS,
        odc_positions,
        [list(c) for c in plan.counts],
        even,
        plugin_modules=["odc_plugin.verl.plugin"],
    )
    return plan, results


def test_uneven_shares_step_like_verl_on_the_same_mini_batches(two_ranks):
    plan, results = two_ranks
    assert any(len(set(c)) > 1 for c in zip(*plan.counts)), plan.counts  # the shares really are uneven
    for rank, res in enumerate(results):
        assert res["odc"]["engine"] == "ODCEngineWithLMHead"
        # one optimizer step per mini-batch with this rank's share of it; the lr scheduler steps once, last
        assert res["odc"]["steps"] == [(c, i == len(plan.counts[rank]) - 1) for i, c in enumerate(plan.counts[rank])]
        assert res["fsdp2"]["steps"] == [(MINI // 2, False), (MINI // 2, True)]
        for name, value in res["odc"]["state"].items():
            torch.testing.assert_close(value, res["fsdp2"]["state"][name], rtol=1e-5, atol=1e-7, msg=name)
        odc, stock = res["odc"]["metrics"], res["fsdp2"]["metrics"]
        assert len(odc["grad_norm"]) == len(stock["grad_norm"]) == BATCH // MINI
        torch.testing.assert_close(torch.tensor(odc["grad_norm"]), torch.tensor(stock["grad_norm"]))
        # the engine's own per-rank values survive the fold: one per rank and mini-batch
        assert len(odc["odc/micro_batches_max"]) == 2 * (BATCH // MINI)
