"""verl backend `odc` with `fsdp_size=2` on 4 CPU gloo ranks (HSDP: 2 simulated nodes x 2 ranks)
against verl's own `fsdp2` engine on the same mesh (tests/verl/harness.py).

One actor update each: `fsdp2` on verl's even split, `odc` on the even split and on an uneven one
(2, 5, 3 and 2 samples); all must agree. An `fsdp_size` that does not divide the world size is refused
with an error naming the key.
"""

from __future__ import annotations

import pytest
import torch

from tests.verl import harness as H

WORLD = 4
FSDP_SIZE = 2
BATCH = 12
SEED = 0
UNEVEN = [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9], [10, 11]]


def _body(rank, world_size, model_dir):
    even = H.make_grpo_batch(SEED, BATCH, world_size=world_size, rank=rank)
    uneven = H.make_grpo_batch(SEED, BATCH, indices=UNEVEN[rank])
    hsdp = {"fsdp_size": FSDP_SIZE}
    out = {}
    for strategy, split in (("fsdp2", "even"), ("odc", "even"), ("odc", "uneven")):
        actor = H.build_engine("language_model", strategy, model_dir, engine_kwargs=hsdp, **H.SGD)
        mesh = actor.engine.device_mesh
        before = H.full_state_dict(actor)
        calls = H.count_micro_batches(actor)
        if split == "even":
            H.actor_update(actor, even)
        else:
            H.train_step(actor, uneven)
        out[strategy, split] = {
            "mesh": tuple(mesh.shape),
            "micro_batches": len(calls),
            "before": before,
            "after": H.full_state_dict(actor),
        }
        del actor
    try:
        H.build_engine("language_model", "odc", model_dir, engine_kwargs={"fsdp_size": 3}, **H.SGD)
    except ValueError as e:
        out["bad_fsdp_size"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    return H.run_on_ranks(_body, WORLD, model_dir, plugin_modules=H.PLUGIN)


def test_odc_builds_the_same_hsdp_mesh_as_fsdp2(runs):
    for r in runs:
        assert r["fsdp2", "even"]["mesh"] == r["odc", "even"]["mesh"] == (WORLD // FSDP_SIZE, FSDP_SIZE)


def test_actor_update_equals_fsdp2_hsdp(runs):
    before, after = runs[0]["fsdp2", "even"]["before"], runs[0]["fsdp2", "even"]["after"]
    assert any(not torch.equal(before[k], after[k]) for k in before)
    worst = 0.0
    for r in runs:
        want = r["fsdp2", "even"]["after"]
        for split in ("even", "uneven"):
            got = r["odc", split]["after"]
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=f"{split}: {name}")
                worst = max(worst, float((got[name] - want[name]).abs().max()))
    print(f"max |odc - fsdp2| after one HSDP actor update: {worst:.3g}")
    counts = [r["odc", "uneven"]["micro_batches"] for r in runs]
    assert len(set(counts)) > 1, counts


def test_fsdp_size_not_dividing_the_world_size_names_the_key(runs):
    for r in runs:
        assert r["bad_fsdp_size"].startswith("fsdp_size=3 must divide the world size 4"), r["bad_fsdp_size"]
