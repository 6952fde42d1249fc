"""LB-Mini dispatch from a batch to per-rank shares of every optimizer step (odc_plugin/verl/dispatch.py and
the patches patches/lb_mini_dispatch.py, patches/lb_mini_worker.py).

* verl's own steps: the samples every optimizer step trains on under fsdp2 (verl's chunks and iterator);
* the plan: every step's samples once, uneven counts, at least one sample per rank, verl's own pieces kept
  when LB-Mini predicts no gain, fixed micro-batch sizes, errors, determinism;
* the split of a batch's TransferQueue metadata by a plan: each sample once per rank, steps as indices;
* the settings a role gets from its engine config (which runs are ODC + LB-Mini) (the losses refused:
  tests/verl/test_loss_probe.py);
* verl's v1 PPOTrainer as main_ppo builds it for the config (real `_balance_batch` / `_update_actor` /
  `_update_critic` on a real hydra config; the worker groups are stand-ins, since Ray workers and
  TransferQueue cannot run here);
* the odc workers' dispatch inside verl's real `dispatch_nd_compute` (Ray object store, stand-in worker group);
* the odc `TrainingWorker.train_mini_batch` on 2 gloo ranks with the `odc` engine and uneven shares,
  against stock fsdp2's own `train_mini_batch` on verl's split of the same batch, several mini-batches and
  epochs, shuffled: the same samples in every optimizer step, the same weights.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_plugin.verl.dispatch import (
    PLAN_KEY,
    STEPS_KEY,
    PlanRequest,
    StepPlan,
    _fill_empty_ranks,
    lb_mini_settings,
    plan_metrics,
    plan_steps,
    split_by_plan,
    verl_steps,
)
from tests.verl import harness as H
from tests.verl.dispatch_ranks import odc_vs_stock_update

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None
needs_tq = pytest.mark.skipif(
    not HAS_TQ,
    reason="verl's v1 trainer and KVBatchMeta need the TransferQueue package (pip install TransferQueue==0.1.10)",
)


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


def _in_order(n: int, dp: int, per_rank: int) -> list[list[list[int]]]:
    """verl's steps without shuffling, one epoch: rank r's chunk cut in order into pieces of `per_rank`."""
    chunk = n // dp
    return [
        [list(range(r * chunk + s * per_rank, r * chunk + (s + 1) * per_rank)) for r in range(dp)]
        for s in range(chunk // per_rank)
    ]


def _check_plan(plan: StepPlan, stock) -> None:
    assert plan.num_steps == len(stock) and plan.dp_size == len(stock[0])
    for step, stock_step in zip(plan.steps, stock):
        # every step trains on exactly verl's samples of that step, each once, a sample or more on every rank
        assert sorted(p for share in step for p in share) == sorted(p for piece in stock_step for p in piece)
        assert all(share for share in step)
    for r in range(plan.dp_size):
        positions = plan.rank_positions(r)
        assert len(positions) == len(set(positions))
        assert [[positions[i] for i in idx] for idx in plan.rank_steps(r)] == [list(s[r]) for s in plan.steps]


# ---------------------------------------------------------------------------------------------
# verl's steps, and the plan
# ---------------------------------------------------------------------------------------------


@needs_tq
def test_verl_steps_are_the_mini_batches_verl_forms():
    batch = _kv_batch([10] * 16, mini_batch_size=8, epochs=1, seed=7)
    assert verl_steps(batch, 2, update=True) == _in_order(16, 2, 4)
    assert verl_steps(batch, 2, update=False) == [[list(range(8)), list(range(8, 16))]]  # forward only: the chunks
    batch.extra_info.update(epochs=3, dataloader_kwargs={"shuffle": True})
    steps = verl_steps(batch, 2, update=True)
    assert len(steps) == 6
    for epoch in range(3):
        # every epoch trains on every sample once; each rank only on its own chunk, reshuffled per epoch
        assert sorted(p for step in steps[2 * epoch : 2 * epoch + 2] for piece in step for p in piece) == list(
            range(16)
        )
        assert all(set(step[r]) <= set(range(8 * r, 8 * r + 8)) for step in steps for r in range(2))
    assert steps[:2] != steps[2:4] and steps == verl_steps(batch, 2, update=True)
    # ranks shuffle with seed + rank: their orders differ
    assert [p - 8 for p in steps[0][1]] != steps[0][0]
    del batch.extra_info["mini_batch_size"]
    batch.extra_info["num_mini_batch"] = 4
    assert len(verl_steps(batch, 2, update=True)) == 12
    with pytest.raises(ValueError, match="mini_batch_size=6 does not divide over 4 ranks"):
        verl_steps(_kv_batch([10] * 16, mini_batch_size=6), 4, update=True)


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 4),
    per_rank=st.integers(1, 4),
    num_steps=st.integers(1, 3),
    data=st.data(),
)
def test_plan_covers_every_step_once_with_a_sample_per_rank(dp, per_rank, num_steps, data):
    n = dp * per_rank * num_steps
    lens = data.draw(st.lists(st.integers(1, 96), min_size=n, max_size=n))
    stock = _in_order(n, dp, per_rank)
    plan = plan_steps(lens, stock, max_token_len=96)
    _check_plan(plan, stock)
    assert plan == plan_steps(list(lens), stock, max_token_len=96)  # deterministic


def test_plan_counts_may_differ_and_beat_verls_pieces():
    # one long sequence per step: verl's equal pieces put it with as many samples as the others get
    lens = [60, 8, 8, 8, 8, 8, 8, 8] * 2
    stock = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]]
    plan = plan_steps(lens, stock, max_token_len=64)
    _check_plan(plan, stock)
    assert all(sorted(map(len, step)) == [1, 7] for step in plan.steps)  # the 60-token sample alone
    # busiest rank: 60 tokens; verl's pieces put 60 + 3 * 8 = 84 on one rank
    assert all(max(sum(lens[p] for p in share) for share in step) == 60 for step in plan.steps)
    metrics = plan_metrics(plan, lens, "tokens", "odc_balance")
    assert metrics["odc_balance/samples_min"] < metrics["odc_balance/samples_max"]
    assert metrics["odc_balance/efficiency"] == pytest.approx(1.0)
    assert metrics["odc_balance/mini_batches"] == 2


def test_plan_keeps_verls_pieces_sample_for_sample_when_no_split_is_faster():
    lens = [30, 10, 20, 20, 10, 30, 20, 20]
    stock = [[[5, 1, 3, 2], [0, 4, 7, 6]]]  # shuffled pieces: their order is kept too
    assert plan_steps(lens, stock, max_token_len=64).steps == ((tuple(stock[0][0]), tuple(stock[0][1])),)


def test_fill_empty_ranks_takes_the_cheapest_sample_of_the_fullest_rank():
    shares = [[0, 1, 2], [], [3, 4], []]
    _fill_empty_ranks(shares, [5.0, 1.0, 3.0, 0.5, 9.0])
    # rank 0 (3 samples) gives its cheapest (1); then ranks 0 and 2 tie at 2 and the lower rank gives
    assert shares == [[0], [1], [3, 4], [2]]


def test_plan_fixed_micro_batch_size_and_flops_cost():
    """With verl's fixed micro-batch size a share is cut into pieces of that size and a smaller last one:
    LB-Mini counts a rank's micro-batches so, whatever their tokens."""
    from odc_plugin.balance import get_cost_model

    lens = [10, 200, 30, 40, 50, 60, 20, 20]
    model = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    stock = _in_order(8, 2, 4)
    plan = plan_steps(lens, stock, max_token_len=None, micro_batch_size=2, cost=get_cost_model("flops", model=model))
    _check_plan(plan, stock)
    assert sorted(map(len, plan.steps[0])) == [1, 7]  # the 200-token sample alone, no token budget to respect
    assert plan.micro_batches[0] == tuple(-(-len(share) // 2) for share in plan.steps[0])


@pytest.mark.parametrize(
    ("stock", "kwargs", "match"),
    [
        ([[[0, 1], []]], {"max_token_len": 64}, "leaves one of 2 data-parallel ranks without a sample"),
        ([[[0], [1]]], {"max_token_len": 5}, "more than the per-micro-batch budget"),
        ([[[0], [1]]], {"max_token_len": None}, "give max_token_len"),
        ([[[0], [1]]], {"max_token_len": None, "micro_batch_size": 0}, "micro_batch_size must be an integer >= 1"),
    ],
)
def test_plan_errors(stock, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_steps([10, 10], stock, **kwargs)


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
    kw = {"use_dynamic_bsz": True, "max_token_len": 64, "micro_batch_size": None}
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


@needs_tq
def test_split_by_plan_gives_each_rank_its_samples_once_and_its_steps():
    lens = [60, 8, 8, 8, 30, 30, 30, 4]
    # two epochs, reshuffled: a sample may run on another rank in the second epoch
    batch = _kv_batch(lens, temperature=1.0, mini_batch_size=4, epochs=2, dataloader_kwargs={"shuffle": True})
    request = PlanRequest(lb_mini_settings(_engine_config("odc", odc_cost_model="tokens"), **_DYNAMIC), update=True)
    batch.extra_info[PLAN_KEY] = request
    pieces = split_by_plan(batch, 2)
    plan = request.plan
    assert request.seqlens == lens and request.fit is None and request.plan_s > 0
    _check_plan(plan, verl_steps(batch, 2, update=True))
    for r, piece in enumerate(pieces):
        assert [t["i"] for t in piece.tags] == plan.rank_positions(r)
        assert piece.keys == [batch.keys[p] for p in plan.rank_positions(r)]
        assert piece.extra_info == {
            "temperature": 1.0,
            "mini_batch_size": 4,
            "epochs": 2,
            "dataloader_kwargs": {"shuffle": True},
            STEPS_KEY: plan.rank_steps(r),
        }
        assert piece.partition_id == "train" and piece.fields == ["input_ids"]
    assert batch.extra_info[PLAN_KEY] is request  # the caller's batch is left alone


_DYNAMIC = {"use_dynamic_bsz": True, "max_token_len": 64, "micro_batch_size": None}


# ---------------------------------------------------------------------------------------------
# verl's v1 trainer, as main_ppo builds it
# ---------------------------------------------------------------------------------------------


class _WorkerGroup:
    """Stand-in for the actor / critic RayWorkerGroup: records what the patched dispatch would send."""

    def __init__(self, mesh):
        self._dispatch_info = {mesh: [0, 1]}
        self.sent = []
        self.reports = {}  # further metrics the engines report (e.g. the auto cost's fit)

    def _receive(self, batch):
        """What the patched dispatch does in the driver with a batch carrying a plan request."""
        request = batch.extra_info.get(PLAN_KEY)
        pieces = split_by_plan(batch, 2) if request is not None else None
        self.sent.append(({k: v for k, v in batch.extra_info.items() if k != PLAN_KEY}, request, pieces))
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

    from odc_plugin.verl.trainer import trainer_class

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
    # the class main_ppo would build for this config (verl's, or its odc subclass); __init__ would start Ray
    trainer = object.__new__(trainer_class(get_trainer_cls("sync"), config))
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
def test_trainer_plans_lb_mini_updates_for_odc_on_verls_steps(tmp_path):
    trainer = _trainer(tmp_path, "actor_rollout_ref.actor.strategy=odc", "critic.strategy=odc")
    # verl's own balancing, unpatched: its order is what the dispatch chunks
    balanced = trainer._balance_batch(_kv_batch(LENS), metrics={})
    metrics = {}
    trainer._update_critic(balanced, metrics)
    trainer._update_actor(balanced, metrics)
    for wg, mini in ((trainer.critic_wg, 12), (trainer.actor_rollout_wg, 6)):
        ((extra, request, pieces),) = wg.sent
        assert extra["mini_batch_size"] == mini
        # the steps are verl's own for this batch, as the trainer dispatched it
        stock = verl_steps(_with(balanced, extra), 2, update=True)
        _check_plan(request.plan, stock)
        assert len(request.plan.steps) == len(LENS) // mini
        assert [p.extra_info[STEPS_KEY] for p in pieces] == [request.plan.rank_steps(r) for r in range(2)]
        positions = [request.plan.rank_positions(r) for r in range(2)]
        assert [p.keys for p in pieces] == [[balanced.keys[i] for i in share] for share in positions]
    assert PLAN_KEY not in balanced.extra_info  # only for the duration of the call
    # uneven: the 60-token sample sits nearly alone
    assert metrics["odc_balance/samples_min"] < metrics["odc_balance/samples_max"]
    for key in ("min", "max", "efficiency", "samples_min", "samples_max", "micro_batches_max", "plan_s", "dispatch_s"):
        assert f"odc_balance/{key}" in metrics and f"odc_balance/critic/{key}" in metrics
    assert metrics["perf/mfu/actor"] == 0.5 and metrics["perf/mfu/critic"] == 0.5


def _with(batch, extra_info):
    from transfer_queue import KVBatchMeta

    return KVBatchMeta(keys=batch.keys, tags=batch.tags, partition_id="train", fields=[], extra_info=extra_info)


@needs_tq
def test_trainer_refuses_the_loss_that_depends_on_micro_batches(tmp_path):
    trainer = _trainer(
        tmp_path,
        "actor_rollout_ref.actor.strategy=odc",
        "critic.strategy=fsdp2",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    )
    with pytest.raises(ValueError, match="set actor_rollout_ref.actor.loss_scale_factor"):
        trainer.init()  # the odc trainer's, before verl's own starts anything
    assert trainer.actor_rollout_wg.sent == []


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
    trainer._update_actor(balanced, {})
    ((_, first, _),) = trainer.actor_rollout_wg.sent
    flops = _trainer(tmp_path / "flops", "actor_rollout_ref.actor.strategy=odc", "critic.strategy=fsdp2")
    flops._update_actor(flops._balance_batch(_kv_batch(LENS), metrics={}), {})
    assert first.plan == flops.actor_rollout_wg.sent[0][1].plan and first.fit is None  # no timings yet

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
    assert "odc_balance/prediction_error" not in metrics  # that plan was made before the fit

    metrics = {}
    trainer._update_actor(balanced, metrics)
    _, request, _ = trainer.actor_rollout_wg.sent[-1]
    assert request.fit.speeds == (1.0, 0.5)
    tokens = dict(zip(balanced.keys, (t["seq_len"] for t in balanced.tags)))
    per_rank = [sum(tokens[balanced.keys[p]] for p in request.plan.rank_positions(r)) for r in range(2)]
    assert per_rank[1] < per_rank[0]  # the slow rank gets less
    from odc_plugin.verl.dispatch import plan_seconds

    predicted = plan_seconds(request.plan, request.seqlens, request.fit)
    assert len(predicted) == 2 and all(p > 0 for p in predicted)
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
    trainer = _trainer(tmp_path, *overrides)
    metrics = {}
    balanced = trainer._balance_batch(_kv_batch(LENS), metrics=metrics)
    trainer._update_actor(balanced, metrics)
    ((_, request, pieces),) = trainer.actor_rollout_wg.sent
    assert request is None and pieces is None and not any(k.startswith("odc_balance") for k in metrics)


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

    from odc_plugin.verl.workers import ODCActorRolloutRefWorker, ODCTrainingWorker

    # 4 workers, data-parallel ranks [0, 0, 1, 1] (e.g. 2-way model parallel): workers 0,1 get rank 0's share
    wg = object.__new__(WorkerGroup)
    wg._workers = [None] * 4
    wg._dispatch_info = {"actor": [0, 0, 1, 1], "train": [0, 0, 1, 1]}
    lens = [60, 8, 8, 8, 30, 30, 30, 4]
    settings = lb_mini_settings(_engine_config("odc", odc_cost_model="tokens"), **_DYNAMIC)
    for method in (ODCActorRolloutRefWorker.update_actor, ODCTrainingWorker.train_mini_batch):
        dispatch = getattr(method, MAGIC_ATTR)["dispatch_mode"]["dispatch_fn"]
        batch = _kv_batch(lens, mini_batch_size=4)
        request = PlanRequest(settings, update=True)
        batch.extra_info[PLAN_KEY] = request
        args, kwargs = dispatch(wg, batch)
        sent = ray_local.get(list(args[0]))
        assert not kwargs and len(sent) == 4
        assert request.plan.steps != tuple((tuple(a), tuple(b)) for a, b in verl_steps(batch, 2, update=True))
        for worker, dp_rank in enumerate([0, 0, 1, 1]):
            assert sent[worker].keys == [batch.keys[p] for p in request.plan.rank_positions(dp_rank)]
            assert sent[worker].extra_info[STEPS_KEY] == request.plan.rank_steps(dp_rank)
            assert PLAN_KEY not in sent[worker].extra_info
        # without a plan verl's own dispatch runs: equal chunks (a TensorDict needs no TransferQueue)
        td = TensorDict({"x": torch.arange(8)}, batch_size=[8])
        args, _ = dispatch(wg, td)
        assert [ray_local.get(a)["x"].tolist() for a in args[0]] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2


# ---------------------------------------------------------------------------------------------
# the odc workers' train_mini_batch on 2 ranks, for real
# ---------------------------------------------------------------------------------------------

SEED, BATCH, MINI = 27, 16, 8  # seed 27: LB-Mini splits all four steps unevenly
# two mini-batches, two epochs, reshuffled: four optimizer steps whose samples verl decides per rank
SHARED = {"mini_batch_size": MINI, "epochs": 2, "shuffle": True}
BATCHING = {
    "dynamic": {"max_token_len_per_gpu": 64},
    "fixed micro-batch size": {"micro_batch_size_per_gpu": 2},  # shares of 3 or 5 end in a smaller one
}


@pytest.fixture(scope="module", params=list(BATCHING))
def two_ranks(request, tmp_path_factory):
    batching = BATCHING[request.param]
    samples = H.make_grpo_samples(SEED, BATCH)
    batch = _kv_batch([len(s["input_ids"]) for s in samples], **SHARED, dataloader_kwargs={"shuffle": True}, seed=42)
    dynamic = "max_token_len_per_gpu" in batching
    settings = lb_mini_settings(
        _engine_config("odc", odc_cost_model="tokens"),
        use_dynamic_bsz=dynamic,
        max_token_len=batching.get("max_token_len_per_gpu"),
        micro_batch_size=batching.get("micro_batch_size_per_gpu"),
    )
    plan_request = PlanRequest(settings, update=True)
    batch.extra_info[PLAN_KEY] = plan_request
    split_by_plan(batch, 2)
    plan = plan_request.plan
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    results = H.run_on_ranks(
        odc_vs_stock_update,
        2,
        model_dir,
        SEED,
        BATCH,
        {**SHARED, **batching},
        [plan.rank_positions(r) for r in range(2)],
        [plan.rank_steps(r) for r in range(2)],
        plugin_modules=["odc_plugin.verl.plugin"],
    )
    return batching, plan, results


def test_uneven_shares_train_verls_mini_batches_step_for_step(two_ranks):
    """Every optimizer step under odc trains on the samples stock verl's own train_mini_batch forms for it
    (its chunks, its iterator over 2 mini-batches x 2 reshuffled epochs), split unevenly over the ranks;
    the weights after all four steps equal stock fsdp2's."""
    batching, plan, results = two_ranks
    assert any(len({len(share) for share in step}) > 1 for step in plan.steps), plan.steps  # really uneven
    steps = {s: [res[s]["steps"] for res in results] for s in ("odc", "fsdp2")}
    assert len(steps["fsdp2"][0]) == len(steps["odc"][0]) == 4
    for i in range(4):
        trained = {s: sorted(sample for rank in steps[s] for sample in rank[i][0]) for s in steps}
        assert trained["odc"] == trained["fsdp2"], f"step {i} trains on other samples"
        # the lr scheduler steps once, on the last step, on every rank
        assert all(rank[i][1] == (i == 3) for s in steps for rank in steps[s])
    assert steps["fsdp2"][0][0][0] != steps["fsdp2"][0][2][0]  # the epochs really were reshuffled
    for rank, res in enumerate(results):
        assert res["odc"]["engine"] == "ODCEngineWithLMHead"
        for name, value in res["odc"]["state"].items():
            torch.testing.assert_close(value, res["fsdp2"]["state"][name], rtol=1e-5, atol=1e-7, msg=name)
        odc, stock = res["odc"]["metrics"], res["fsdp2"]["metrics"]
        assert len(odc["grad_norm"]) == len(stock["grad_norm"]) == 4
        torch.testing.assert_close(torch.tensor(odc["grad_norm"]), torch.tensor(stock["grad_norm"]))
        torch.testing.assert_close(torch.tensor(odc["actor/pg_loss"]), torch.tensor(stock["actor/pg_loss"]))
        # the engine's own per-rank values survive the fold: one per rank and step
        assert len(odc["odc/micro_batches_max"]) == 2 * 4
        # the engine runs the micro-batches the plan predicts (LB-Mini packs with verl's functions, as it does)
        assert len(res["odc"]["micro_batches"]) == sum(step[rank] for step in plan.micro_batches)
        if "micro_batch_size_per_gpu" in batching:
            size = batching["micro_batch_size_per_gpu"]
            assert max(res["odc"]["micro_batches"]) <= size  # never more than the configured size
            shares = [len(step[rank]) for step in plan.steps]
            assert len(res["odc"]["micro_batches"]) == sum(-(-n // size) for n in shares)
