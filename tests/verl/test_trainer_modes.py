"""verl's trainer modes (`trainer.v1.trainer_mode`) under strategy=odc, through verl's real trainer on 2 CPU
ranks (`main_ppo`, odc-grpo-cpu's configuration with the KL loss, so that the reference model runs too).

- `colocate_async` (rollout and training colocated, a batch generated ahead, one step off-policy from
  step 2; the sampler waits for every prompt in flight, so that both runs train the same groups), with
  multi-turn trajectories (agent loop `odc_cpu_multi_turn`: one to three assistant turns, a tool-like
  observation after each but the last, masked out of the loss): odc trains as fsdp2 does, step by step,
  with LB-Mini planning every FSDP pass (the actor's update, its old log-probs, the reference log-probs).
- `sync`: the default, which every other trainer test runs.
- `separate_async` (the rollout in processes of its own, a standalone replica, sent the weights by the CPU's
  `gloo` checkpoint engine; 2 mini-batches per step, each sampled and trained on its own, the second's old
  log-probs from the cycle's first weights, which verl's DetachActorWorker saves and restores): odc trains as
  fsdp2 does, step by step, with every FSDP pass planned. verl's asynchrony is turned off
  (`num_warmup_batches=0`: a step's batch is generated after the previous step's weights are sent), so that
  both runs generate every batch from the same weights.
- verl's legacy trainer (`trainer.use_v1=False`, `main_ppo_v0`), as a user would try it with several
  mini-batches: fsdp2 trains, and its metrics (which log the agent loop's counts under timing_s/) make an A/B
  report; odc is refused in one line naming trainer.use_v1, before any worker starts.
"""

from __future__ import annotations

import pytest

from odc_plugin.verl import ab_report
from odc_plugin.verl.cpu import grpo
from odc_plugin.verl.cpu.agent_loop import AGENT_NAME
from odc_plugin.verl.cpu.assets import ensure_assets
from odc_plugin.verl.trainer import LEGACY_REFUSAL
from tests.verl import golden
from tests.verl.golden import relative_difference
from tests.verl.trainer_runs import close, train, worst_difference

STEPS = 2
COLOCATE_ASYNC = [
    "trainer.v1.trainer_mode=colocate_async",
    # multi-turn trajectories (the CPU A/B's agent loop: observations masked out of the loss), in the same runs
    f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
    # verl samples whichever prompt groups finished first, so which groups make a step would depend on timing;
    # waiting until none is in flight makes both runs train the same ones (the window of one batch ahead,
    # and the step-old responses trained from step 2 on, stay)
    "trainer.v1.sampler.max_off_policy_threshold=1",
    "trainer.v1.sampler.max_off_policy_strategy=wait",
    *golden.KL_LOSS,
]
SEPARATE_ASYNC = [
    "trainer.v1.trainer_mode=separate_async",
    # train_batch_size (8 prompts) = parameter_sync_step x ppo_mini_batch_size, as verl requires
    "trainer.v1.separate_async.parameter_sync_step=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.v1.separate_async.num_warmup_batches=0",
    "trainer.v1.sampler.max_off_policy_threshold=1",
    "trainer.v1.sampler.max_off_policy_strategy=wait",
    # the standalone rollout: one replica of one rank, on a third (CPU) "GPU" of Ray's, its weights sent over gloo
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
    "ray_kwargs.ray_init.num_gpus=3",
    *golden.KL_LOSS,
]
LEGACY = ["trainer.use_v1=False", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
# the FSDP passes of this job, each planned by LB-Mini under odc (odc_balance/<pass>/...)
PLANNED = ("odc_balance/efficiency", "odc_balance/old_log_prob/efficiency", "odc_balance/ref_log_prob/efficiency")


@pytest.fixture(scope="module")
def colocate_async(tmp_path_factory):
    out, assets = tmp_path_factory.mktemp("trainer_modes"), ensure_assets()
    return {s: train(out, assets, "colocate-async", s, STEPS, COLOCATE_ASYNC) for s in grpo.STRATEGIES}


def test_colocate_async_trains_under_odc_as_under_fsdp2_step_by_step(colocate_async):
    fsdp2, odc = (colocate_async[s] for s in grpo.STRATEGIES)
    fsdp2.assert_ok(STEPS)
    odc.assert_ok(STEPS)
    assert "odc: ODCEngineWithLMHead on 2 ranks" in odc.log() and "odc: ODCEngine" not in fsdp2.log()
    worst = 0.0
    for step in range(1, STEPS + 1):
        a, b = fsdp2.metrics[step], odc.metrics[step]
        assert a["num_turns/max"] > 2, a["num_turns/max"]  # trajectories of several assistant turns
        keys = ("critic/score/mean", "response_length/mean", "num_turns/mean")
        for key in (*keys, "training/off_policy/trajectory_staleness/max"):
            assert a[key] == b[key], (step, key)  # the same rollouts, as off-policy as under fsdp2
        # step 1 is the same update on the same weights (float32 sums split otherwise: ~1e-7); from step 2
        # the weights differ by that rounding, and so do the log-probs the update starts from
        rtol = 1e-5 if step == 1 else 1e-4
        for key in ("actor/grad_norm", "actor/kl_loss", "actor/entropy"):
            assert close(a[key], b[key], rtol), (step, key, a[key], b[key])
            worst = max(worst, relative_difference(a[key], b[key]))
        # GRPO's policy loss sums advantages that cancel: near zero, where only its absolute error means anything
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) <= 1e-6, (step, a["actor/pg_loss"], b["actor/pg_loss"])
        assert all(key in b for key in PLANNED) and not any(key in a for key in PLANNED), step
    assert fsdp2.metrics[STEPS]["training/off_policy/trajectory_staleness/max"] >= 1  # really asynchronous
    print(f"colocate_async, odc against fsdp2: worst relative difference {worst:.2g}")  # README's settings table


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    out, assets = tmp_path_factory.mktemp("trainer_modes"), ensure_assets()
    return {s: train(out, assets, "legacy", s, STEPS, LEGACY, timeout_s=600) for s in grpo.STRATEGIES}


def test_the_legacy_trainer_trains_fsdp2_and_refuses_odc_in_one_line_at_start(legacy, capsys):
    fsdp2, odc = (legacy[s] for s in grpo.STRATEGIES)
    fsdp2.assert_ok(STEPS)
    assert fsdp2.metrics[1]["timing_s/agent_loop/num_preempted/min"] == -1  # a count, logged under timing_s/
    assert ab_report.main([fsdp2.result.metrics_file, fsdp2.result.metrics_file]) == 0
    assert "update phase s/step" in capsys.readouterr().out
    odc.assert_refused_at_start(f"ValueError: {LEGACY_REFUSAL}")


@pytest.fixture(scope="module")
def separate_async(tmp_path_factory):
    out, assets = tmp_path_factory.mktemp("trainer_modes"), ensure_assets()
    return {s: train(out, assets, "separate-async", s, STEPS, SEPARATE_ASYNC) for s in grpo.STRATEGIES}


def test_separate_async_trains_under_odc_as_under_fsdp2_step_by_step(separate_async):
    fsdp2, odc = (separate_async[s] for s in grpo.STRATEGIES)
    fsdp2.assert_ok(STEPS)
    odc.assert_ok(STEPS)
    assert "odc: ODCEngineWithLMHead on 2 ranks" in odc.log() and "odc: ODCEngine" not in fsdp2.log()
    worst, where = worst_difference(fsdp2.metrics, odc.metrics, STEPS, golden.CLOSE, required=golden.CLOSE)
    for step in range(1, STEPS + 1):
        a, b = fsdp2.metrics[step], odc.metrics[step]
        # the old log-probs of both mini-batches came from the weights the rollout generated with (the second's
        # from the restored ones: from the weights after the first update they would differ by ~1e-3)
        for run in (a, b):
            assert run["training/rollout_probs_diff_max"] < 1e-4, (step, run["training/rollout_probs_diff_max"])
        assert all(key in b for key in PLANNED) and not any(key in a for key in PLANNED), step
    print(f"separate_async, odc against fsdp2: worst relative difference {worst:.2g} ({where})")  # README's table
