"""CPU mode's `gloo` checkpoint engine, as verl's CheckpointEngineManager drives it (`verl/checkpoint_engine/base.py`,
`update_weights`: prepare on every worker, the topology from their metadata, the group, then the trainer's ranks
send while the rollout's receive, and finalize), here with the workers as threads of one process: two training
ranks and two rollout workers. The whole path, through verl's trainer and a standalone rollout:
tests/verl/test_trainer_modes.py (separate_async).
"""

from __future__ import annotations

import asyncio
import threading

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry

from odc_plugin.verl.cpu import checkpoint_engine

ACTORS, ROLLOUT = 2, 2


def _weights(scale: float):
    """What a training rank's engine yields (get_per_tensor_param): every rank yields every full tensor."""
    yield "model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale
    yield "lm_head.weight", torch.ones(2, 4, dtype=torch.bfloat16) * scale


def _update(engines, scale: float) -> list:
    metadata = [e.prepare() for e in engines]
    actor_kwargs, rollout_kwargs = checkpoint_engine.GlooCheckpointEngine.build_topology(ACTORS, ROLLOUT, metadata)
    kwargs = [{k: v[i] for k, v in actor_kwargs.items()} for i in range(ACTORS)]
    kwargs += [{k: v[i] for k, v in rollout_kwargs.items()} for i in range(ROLLOUT)]
    results: list = [None] * len(engines)

    async def received(engine):
        return {name: tensor async for name, tensor in engine.receive_weights()}

    def worker(i):
        engines[i].init_process_group(**kwargs[i])
        if i < ACTORS:
            results[i] = asyncio.run(engines[i].send_weights(_weights(scale)))
        else:
            results[i] = asyncio.run(received(engines[i]))
        engines[i].finalize()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_the_rollout_receives_the_trainers_weights_at_every_update():
    checkpoint_engine.register()
    backend = CheckpointEngineRegistry.get(checkpoint_engine.BACKEND)
    assert backend is checkpoint_engine.GlooCheckpointEngine
    engines = [backend(bucket_size=1 << 20, is_master=i == 0) for i in range(ACTORS)]
    engines += [backend(bucket_size=1 << 20) for _ in range(ROLLOUT)]
    for scale in (1.0, -2.5):  # the group is built again for every update, as verl's manager asks
        results = _update(engines, scale)
        assert results[:ACTORS] == [{}] * ACTORS  # no metrics of their own
        expected = dict(_weights(scale))
        for received in results[ACTORS:]:
            assert received.keys() == expected.keys()
            for name, tensor in expected.items():
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
