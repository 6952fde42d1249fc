"""LB-Mini's dispatch through verl (patches/lb_mini_dispatch.py, patches/lb_mini_worker.py); the plan itself:
test_lb_mini_plan.py.

* verl's v1 PPOTrainer as main_ppo builds it for the config (real `_balance_batch` / `_update_actor` /
  `_update_critic` on a real hydra config; the worker groups are stand-ins, since Ray workers and
  TransferQueue cannot run here);
* the odc workers' dispatch inside verl's real `dispatch_nd_compute` (Ray object store, stand-in worker group);
* the odc `TrainingWorker.train_mini_batch` on 2 gloo ranks with the `odc` engine and uneven shares,
  against stock fsdp2's own `train_mini_batch` on verl's split of the same batch, several mini-batches and
  epochs, shuffled: the same samples in every optimizer step, the same weights.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from odc_plugin.verl.dispatch import (
    PLAN_KEY,
    STEPS_KEY,
    PlanRequest,
    lb_mini_settings,
    split_by_plan,
    verl_steps,
)
from tests.verl import harness as H
from tests.verl.dispatch_ranks import odc_vs_stock_update
from tests.verl.lb_mini_cases import DYNAMIC, check_plan, engine_config, kv_batch
from tests.verl.requires import needs_transfer_queue as needs_tq

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
    balanced = trainer._balance_batch(kv_batch(LENS), metrics={})
    metrics = {}
    trainer._update_critic(balanced, metrics)
    trainer._update_actor(balanced, metrics)
    for wg, mini in ((trainer.critic_wg, 12), (trainer.actor_rollout_wg, 6)):
        ((extra, request, pieces),) = wg.sent
        assert extra["mini_batch_size"] == mini
        # the steps are verl's own for this batch, as the trainer dispatched it
        stock = verl_steps(_with(balanced, extra), 2, update=True)
        check_plan(request.plan, stock)
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
    balanced = trainer._balance_batch(kv_batch(LENS), metrics={})
    trainer._update_actor(balanced, {})
    ((_, first, _),) = trainer.actor_rollout_wg.sent
    flops = _trainer(tmp_path / "flops", "actor_rollout_ref.actor.strategy=odc", "critic.strategy=fsdp2")
    flops._update_actor(flops._balance_batch(kv_batch(LENS), metrics={}), {})
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
    balanced = trainer._balance_batch(kv_batch(LENS), metrics=metrics)
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
    settings = lb_mini_settings(engine_config("odc", odc_cost_model="tokens"), **DYNAMIC)
    for method in (ODCActorRolloutRefWorker.update_actor, ODCTrainingWorker.train_mini_batch):
        dispatch = getattr(method, MAGIC_ATTR)["dispatch_mode"]["dispatch_fn"]
        batch = kv_batch(lens, mini_batch_size=4)
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
    batch = kv_batch([len(s["input_ids"]) for s in samples], **SHARED, dataloader_kwargs={"shuffle": True}, seed=42)
    dynamic = "max_token_len_per_gpu" in batching
    settings = lb_mini_settings(
        engine_config("odc", odc_cost_model="tokens"),
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
