"""Multi-turn agent trajectories under odc: verl's real GRPO trainer on 2 CPU ranks with the CPU A/B's agent
loop (`odc_cpu_multi_turn`: one to three assistant turns, a tool-like observation after each but the last,
merged by verl's Continuous Token builder and masked out of the loss), the KL loss on; odc trains as fsdp2
does, step by step."""

from __future__ import annotations

import pytest

from odc_plugin.verl.cpu import grpo
from odc_plugin.verl.cpu.agent_loop import AGENT_NAME
from odc_plugin.verl.cpu.assets import ensure_assets
from tests.verl import golden
from tests.verl.golden import relative_difference
from tests.verl.trainer_runs import close, train

STEPS = 2


@pytest.fixture(scope="module")
def multi_turn(tmp_path_factory):
    out, assets = tmp_path_factory.mktemp("agent_loop"), ensure_assets()
    overrides = [f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}", *golden.KL_LOSS]
    return {s: train(out, assets, "multi-turn", s, STEPS, overrides) for s in grpo.STRATEGIES}


def test_multi_turn_trajectories_train_under_odc_as_under_fsdp2(multi_turn):
    fsdp2, odc = (multi_turn[s] for s in grpo.STRATEGIES)
    fsdp2.assert_ok(STEPS)
    odc.assert_ok(STEPS)
    assert "odc: ODCEngineWithLMHead on 2 ranks" in odc.log()
    worst = 0.0
    for step in range(1, STEPS + 1):
        a, b = fsdp2.metrics[step], odc.metrics[step]
        assert a["num_turns/max"] > 2, a["num_turns/max"]  # trajectories of several assistant turns
        for key in ("critic/score/mean", "response_length/mean", "num_turns/mean"):
            assert a[key] == b[key], (step, key)  # the same trajectories
        rtol = 1e-5 if step == 1 else 1e-4
        for key in ("actor/grad_norm", "actor/kl_loss", "actor/entropy"):
            assert close(a[key], b[key], rtol), (step, key, a[key], b[key])
            worst = max(worst, relative_difference(a[key], b[key]))
        # GRPO's policy loss sums advantages that cancel: near zero, where only its absolute error means anything
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) <= 1e-6, (step, a["actor/pg_loss"], b["actor/pg_loss"])
    print(f"multi-turn agent loop, odc against fsdp2: worst relative difference {worst:.2g}")
