"""verl's `odc` engine when one rank's mini-batch fails before it begins, on 2 CPU gloo ranks.

Rank 1 gets a bad batch: its micro-batch budget (8 tokens) is shorter than its sequences, so verl's own
packing (`rearrange_micro_batches`) raises an AssertionError on rank 1 alone, after the mini-batch's
token all-reduce and before begin(). Rank 0 begins the mini-batch and would wait for rank 1's shards
until the barrier timeout (600 s); instead both end the step within 5 s, rank 1 with its own error,
rank 0 naming rank 1 and that error, and both then train the next step. Also: the forward-only
reference engine holds no gradient region, and the memory ODC adds reaches the trainer's metrics.
"""

from __future__ import annotations

import math
import time

import pytest

from tests.verl import harness as H

WORLD = 2
BATCH = 8
SEED = 0
MAX_TOKENS = 64
UNEVEN = [[0, 1, 2], [3, 4, 5, 6, 7]]
BUDGET_ERROR = "AssertionError: max_token_len must be greater than the sequence length"


def _bad_batch_on_rank_1(rank, world_size, model_dir):
    actor = H.build_engine("language_model", "odc", model_dir, max_token_len_per_gpu=MAX_TOKENS)
    ref = H.build_engine("language_model", "odc", model_dir, forward_only=True, max_token_len_per_gpu=MAX_TOKENS)
    H.compute_log_probs(ref, H.make_grpo_batch(SEED, BATCH, indices=UNEVEN[rank]))
    # what ODC held during the engines' mini-batches: between phases it holds nothing (test_odc_lifecycle)
    out = {"ref": ref.engine.odc.minibatch_memory}
    bad = H.make_grpo_batch(SEED, BATCH, indices=UNEVEN[rank], max_token_len_per_gpu=8 if rank == 1 else None)
    start = time.monotonic()
    try:
        H.train_step(actor, bad)
        out["outcome"] = "trained"
    except Exception as e:  # noqa: BLE001  (what each rank raised is the result)
        out["outcome"] = f"{type(e).__name__}: {e}"
    out["elapsed"] = time.monotonic() - start
    out["retry"] = H.train_step(actor, H.make_grpo_batch(SEED, BATCH, indices=UNEVEN[rank]))
    out["actor"] = actor.engine.odc.minibatch_memory
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    return H.run_on_ranks(_bad_batch_on_rank_1, WORLD, model_dir, plugin_modules=H.PLUGIN)


def test_a_rank_whose_preparation_raises_ends_the_step_on_every_rank_naming_it(runs):
    assert runs[1]["outcome"].startswith(BUDGET_ERROR), runs[1]["outcome"]
    assert runs[0]["outcome"].startswith(
        f"ODCPeerFailedError: rank 0: rank 1 failed in its mini-batch: {BUDGET_ERROR}"
    ), runs[0]["outcome"]
    for rank, r in enumerate(runs):
        assert r["elapsed"] < 5, (rank, r["elapsed"])
    print(f"the step ended after {runs[0]['elapsed']:.2f} s (rank 0) and {runs[1]['elapsed']:.2f} s (rank 1)")
    for r in runs:  # and the next step trains
        assert math.isfinite(r["retry"]["grad_norm"]), r["retry"]


def test_the_reference_model_holds_no_gradient_region_and_the_metrics_report_odc_memory(runs):
    for rank, r in enumerate(runs):
        assert r["ref"].accumulator == 0 and r["ref"].published > 0, rank
        assert r["actor"].accumulator > 0 and r["actor"].grad_storage > 0, rank  # fp32: `.grad` is the accumulator
        print(
            f"rank {rank}: extra bytes per parameter over FSDP2 (fp32 gathers): actor "
            f"{r['actor'].extra_bytes_per_param:.3f}, reference {r['ref'].extra_bytes_per_param:.3f}"
        )
    reported = runs[0]["retry"]["odc/extra_bytes_per_param"]  # per rank, as the worker gathers metrics
    assert reported == [pytest.approx([max(r["actor"].extra_bytes_per_param for r in runs)])] * WORLD, reported
