"""separate_async's save and restore of the actor (verl's DetachActorWorker) on the odc engine, on 2 CPU gloo
ranks (tests/verl/harness.py, no Ray): verl's `save_model_to_cpu` and the odc worker's `_get_strategy_handlers`
and `restore_model_from_cpu` (patches/detach_actor.py) on the worker state they read, the actor's engine.

The cycle separate_async runs for parameter_sync_step > 1: save the weights (pi_old), train a mini-batch, save
the new weights, restore pi_old for the old log-probs, restore the new ones. Under odc as under fsdp2 the
restored pi_old gives the log-probs it gave before the update bit for bit and ODC holds no region after it,
the restored new weights give those of after the update, and the update, the saves and the restores equal
fsdp2's. (On CPU verl's own save hands back the parameters' shards themselves, which the update then changes:
patches/cpu_sharded_save.py makes them copies, as they are from a GPU.) The whole trainer:
tests/verl/test_trainer_modes.py.
"""

from __future__ import annotations

import types

import torch

from tests.verl import harness as H
from tests.verl.test_odc_lifecycle import _held

WORLD = 2
BATCH = 8


class _Worker:
    """What DetachActorWorker's save and restore read of their worker: the actor's strategy and engine, and the
    saves; the methods are the odc worker's (verl's own for fsdp2)."""

    def __init__(self, strategy, engine):
        from odc_plugin.verl.workers import ODCDetachActorWorker as odc

        self.config = types.SimpleNamespace(actor=types.SimpleNamespace(strategy=strategy))
        self.actor = types.SimpleNamespace(engine=engine)
        self._strategy_handlers = None
        for name in ("_get_strategy_handlers", "save_model_to_cpu", "restore_model_from_cpu", "clear_cpu_model"):
            setattr(self, name, types.MethodType(getattr(odc, name), self))
        self.copy_handler, self.restore_handler = self._get_strategy_handlers()


def _aliases(module) -> bool:
    """Whether verl's own save, on CPU, hands back the parameters' shards themselves (what patches/cpu_sharded_save.py
    replaces with copies: the optimizer would update the saved weights in place)."""
    from verl.utils import fsdp_utils

    shards, _ = fsdp_utils.fsdp2_sharded_save_to_cpu.__wrapped__(module)
    local = {name: p._local_tensor for name, p in module.named_parameters()}
    return all(shard.data_ptr() == local[name].data_ptr() for name, (shard, _) in shards.items())


def _cycle(rank, world_size, model_dir):
    batch = H.make_grpo_batch(0, BATCH, world_size=world_size, rank=rank)
    out = {}
    for strategy in ("fsdp2", "odc"):
        actor = H.build_engine("language_model", strategy, model_dir, **H.SGD)
        worker = _Worker(strategy, actor.engine)
        res = out[strategy] = {"before": H.compute_log_probs(actor, batch)}
        res["verl's save aliases"] = _aliases(actor.engine.module)
        worker.save_model_to_cpu(0)
        H.actor_update(actor, batch)
        res["after"] = H.compute_log_probs(actor, batch)
        res["state after"] = H.full_state_dict(actor)
        worker.save_model_to_cpu(1)
        worker.restore_model_from_cpu(0)
        res["held"] = _held()
        res["restored pi_old"] = H.compute_log_probs(actor, batch)
        worker.restore_model_from_cpu(1)
        worker.clear_cpu_model(1)
        res["restored"] = H.compute_log_probs(actor, batch)
        res["state restored"] = H.full_state_dict(actor)
        del actor
    return out


def test_separate_async_restores_the_odc_actor_as_fsdp2s():
    import tempfile

    with tempfile.TemporaryDirectory() as model_dir:
        runs = H.run_on_ranks(_cycle, WORLD, H.make_tiny_qwen2(model_dir), plugin_modules=H.PLUGIN)
    for rank, r in enumerate(runs):
        for strategy in ("fsdp2", "odc"):
            res = r[strategy]
            assert res["verl's save aliases"], (rank, strategy)
            assert any(not torch.equal(a, b) for a, b in zip(res["before"], res["after"], strict=True))
            for key, expected in (("restored pi_old", "before"), ("restored", "after")):
                for got, want in zip(res[key], res[expected], strict=True):
                    assert torch.equal(got, want), (rank, strategy, key)
            for name, value in res["state restored"].items():
                assert torch.equal(value, res["state after"][name]), (rank, strategy, name)
        assert r["odc"]["held"] == [], (rank, r["odc"]["held"])  # ODC's regions released around the restore
        for key in ("before", "after", "restored pi_old"):
            for got, expected in zip(r["odc"][key], r["fsdp2"][key], strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=key)
        H.assert_state_close(r["odc"]["state restored"], r["fsdp2"]["state restored"], "actor")
