"""A member that raises inside a split micro-batch (odc_split=auto; odc_plugin/verl/split.py), on 4 CPU gloo
ranks: rank 1 raises (as out of memory on the longest sample would) before the split sample's first exchange,
leaving its partner rank 0 inside it. Every rank raises within the barrier timeout, naming rank 1: rank 0 when
its exchange times out (half the barrier timeout), ranks 2 and 3 at the mini-batch's end. The same batch again
trains as a fresh engine trains it: the split's groups are made anew after the failure, so none holds the
failed exchange's messages."""

from __future__ import annotations

import time

import pytest

from odc_plugin.verl.config import ODCEngineConfig
from odc_plugin.verl.split import SplitMicroBatches
from tests.verl import harness as H

WORLD, TIMEOUT_S = 4, 20.0
SHARES = [[0, 1, 2], [0, 3, 4], [5, 6], [7, 8]]  # sample 0 split over ranks 0 and 1, first in both shares


def _batch(rank: int):
    data = H.make_grpo_batch(0, 9, indices=SHARES[rank], response_len=(20, 40))
    if rank < 2:
        SplitMicroBatches.give(data, [[0, 1]])
    return data


def _engine(model_dir):
    return H.build_engine(
        "language_model",
        "odc",
        model_dir,
        engine_config_cls=ODCEngineConfig,
        engine_kwargs={"odc_split": "auto", "odc_barrier_timeout_s": TIMEOUT_S},
    )


def _fail_then_retry(rank, world_size, model_dir):
    worker = _engine(model_dir)
    forward_step = worker.engine.forward_step
    if rank == 1:

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("out of memory (injected) on the split sample")

        worker.engine.forward_step = out_of_memory
    start = time.monotonic()
    try:
        H.train_step(worker, _batch(rank))
        failed = "trained"
    except Exception as e:  # noqa: BLE001  (the error is what the test checks)
        failed = f"{type(e).__name__}: {e}"
    waited = time.monotonic() - start
    worker.engine.forward_step = forward_step
    retried = H.train_step(worker, _batch(rank))["grad_norm"]
    fresh = H.train_step(_engine(model_dir), _batch(rank))["grad_norm"]
    return failed, waited, retried, fresh


def test_a_member_raising_inside_a_split_fails_every_rank_naming_it_and_the_retry_trains_exactly(tmp_path):
    model_dir = H.make_tiny_qwen2(str(tmp_path))
    ranks = H.run_on_ranks(_fail_then_retry, WORLD, model_dir, plugin_modules=H.PLUGIN)
    for rank, (failed, waited, retried, fresh) in enumerate(ranks):
        print(f"rank {rank}: raised after {waited:.1f} s: {failed[:160]}")
        assert waited < TIMEOUT_S, (rank, waited)
        if rank == 1:
            assert failed.startswith("RuntimeError: out of memory (injected)"), failed
        else:
            assert failed.startswith(f"ODCPeerFailedError: rank {rank}: rank 1 failed in its mini-batch"), failed
        assert retried == pytest.approx(fresh, rel=1e-6), (rank, retried, fresh)
