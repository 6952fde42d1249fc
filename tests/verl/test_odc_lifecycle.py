"""ODC's memory follows verl's engine phases, on 2 CPU gloo ranks (tests/verl/harness.py, no Ray).

The calls of one training step, in the trainer's order: the actor's log-probs, the reference model's
log-probs, the actor's update in 2 mini-batches. After each call (where the trainer may hand the device
to the rollout) this process maps no ODC region but the transports' control words, read from its
/proc/self/maps; with the actor's parameter and optimizer offload and the reference model's parameter
offload on, and with them off. The update equals `fsdp2`'s, and the metrics report ODC's memory and the
time it spent rebuilding, the reference model's under `odc/ref/`. The whole trainer is
tests/verl/test_main_ppo_lifecycle.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.fsdp.memory_workers import CONTROL_REGIONS, shm_mappings
from tests.verl import harness as H

WORLD = 2
BATCH = 8
SEED = 0
MAX_TOKENS = 64


def _held() -> list[str]:
    """The ODC regions this process maps, its transports' control words aside."""
    return sorted({m.region for m in shm_mappings() if m.region not in CONTROL_REGIONS})


def _step(rank, world_size, model_dir, offload):
    batch = H.make_grpo_batch(SEED, BATCH, world_size=world_size, rank=rank, mini_batch_size=BATCH // 2)
    out = {}
    for strategy in ("fsdp2", "odc"):
        actor = H.build_engine(
            "language_model",
            strategy,
            model_dir,
            max_token_len_per_gpu=MAX_TOKENS,
            engine_kwargs={"param_offload": offload, "optimizer_offload": offload},
        )
        ref = H.build_engine(
            "language_model",
            strategy,
            model_dir,
            forward_only=True,
            max_token_len_per_gpu=MAX_TOKENS,
            engine_kwargs={"param_offload": offload},
        )
        res = out[strategy] = {"held": {"built": _held()}}
        res["log_probs"] = H.compute_log_probs(actor, batch)
        res["held"]["after log-probs"] = _held()
        res["ref_log_probs"] = H.compute_log_probs(ref, batch)
        res["held"]["after ref log-probs"] = _held()
        res["metrics"] = H.actor_update(actor, batch)
        res["held"]["after the update"] = _held()
        res["actor_after"] = H.full_state_dict(actor)
        del actor, ref
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["offload", "no-offload"])
def runs(request, tmp_path_factory):
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    return H.run_on_ranks(_step, WORLD, model_dir, request.param, plugin_modules=H.PLUGIN)


def test_between_phases_odc_maps_only_its_control_words(runs):
    for rank, r in enumerate(runs):
        assert r["odc"]["held"] == dict.fromkeys(r["odc"]["held"], []), (rank, r["odc"]["held"])


def test_the_step_equals_fsdp2_and_the_metrics_report_odc_memory(runs):
    for r in runs:
        for key in ("log_probs", "ref_log_probs"):
            for got, expected in zip(r["odc"][key], r["fsdp2"][key], strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=key)
        H.assert_state_close(r["odc"]["actor_after"], r["fsdp2"]["actor_after"], "actor")
    metrics = runs[0]["odc"]["metrics"]
    print({k: v for k, v in metrics.items() if "bytes" in k or "rebuild" in k})
    # every mini-batch (2) reports, for each rank, what ODC held outside the phase, its control words and
    # its extra bytes during the mini-batch; the update's last one the time spent building and releasing
    # since the last report (the step's), and the reference model's figures
    assert metrics["odc/held_outside_bytes"] == [0.0] * 2 * WORLD, metrics["odc/held_outside_bytes"]
    assert all(0 < v < 8192 for v in metrics["odc/control_bytes"]), metrics["odc/control_bytes"]
    # the published shards (fp32), padding and flags; under the slots method, which the engine's start-up
    # calibration may pick on a busy machine, the accumulator's copy for each peer too
    slots = metrics["odc/transport/accumulate_slots_chosen"]
    assert len(set(slots)) == 1, slots
    extra = 4 + 4 * (WORLD - 1) * slots[0]
    assert all(extra < v < extra + 1 for v in metrics["odc/extra_bytes_per_param"]), (slots, metrics)
    # the actor's log-probs, a forward-only pass of a trained model: the published shards alone, no accumulator
    forward = metrics["odc/forward_only_extra_bytes_per_param"]
    assert len(forward) == WORLD and all(4 < v < 5 for v in forward), forward
    assert metrics["odc/ref/held_outside_bytes"] == [0.0] * WORLD, metrics["odc/ref/held_outside_bytes"]
    for key in ("odc/rebuild_s", "odc/ref/rebuild_s"):
        assert len(metrics[key]) == WORLD and all(v > 0 for v in metrics[key]), (key, metrics[key])
