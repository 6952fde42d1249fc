"""A mini-batch that fails on one rank fails on every rank, and the next one trains as if it had never run.

3 gloo ranks on the shared-memory transport (and 2 x 2 under HSDP), the barrier timeout at its default
600 s: rank 1 raises at each place a mini-batch can fail (before begin(), after a micro-batch's backward,
halfway through a backward, inside a forward, in end()); every rank catches what it raised and trains a
new mini-batch, whose parameters must equal one process trained on that mini-batch alone.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from odc_plugin.launch import run_ranks
from odc_plugin.models import build_qwen2, token_mean_loss

from ..weights import assert_weights_agree
from . import failure_workers, test_odc_core, workers
from .test_odc_core import random_plan, reference_train_steps

WORLD, CULPRIT = 3, 1
WAIT_BOUND_S = 5.0
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and Triton (the `gpu` extra) for the cuda_ipc transport",
)


def _error(rank: int, culprit: int, where: str) -> str:
    """What rank `rank` raises when `culprit` failed at `where`."""
    own = f"RuntimeError: {failure_workers.INJECTED} ({where}) on rank {culprit}"
    if rank == culprit:
        return own
    return f"ODCPeerFailedError: rank {rank}: rank {culprit} failed in its mini-batch: {own}"


def _check_failed(results, culprit, where):
    for rank, r in enumerate(results):
        assert r["outcome"] == _error(rank, culprit, where), (rank, r["outcome"])
        assert r["elapsed"] < WAIT_BOUND_S, (rank, r["elapsed"])


@pytest.fixture(scope="module")
def retries():
    """Each place of failure in turn: the failed mini-batch (rank 1 runs 3 micro-batches), then a retry
    on other sequences and another split."""
    failed_seqs = workers.make_sequences(9, seed=21)
    failed = (failed_seqs, random_plan(len(failed_seqs), [2, 3, 2], seed=21))
    retried_seqs = workers.make_sequences(9, seed=22)
    retried = (retried_seqs, random_plan(len(retried_seqs), [1, 3, 2], seed=22))
    runs = {
        where: run_ranks(failure_workers.retry_after_failure, WORLD, failed, retried, CULPRIT, where)
        for where in failure_workers.WHERE
    }
    return runs, reference_train_steps(retried_seqs, 1)


@pytest.mark.parametrize("where", failure_workers.WHERE)
def test_a_failed_minibatch_fails_every_rank_at_once_and_the_retry_equals_one_process(retries, where):
    runs, expected = retries
    results = runs[where]
    _check_failed(results, CULPRIT, where)
    assert all(r["grads_dropped"] for r in results)
    for rank, r in enumerate(results):
        print(f"{where}, rank {rank}: {assert_weights_agree(r['params'], expected, 1e-5, where)}")
    print(f"{where}: every rank failed within {max(r['elapsed'] for r in results):.2f} s")


def reference_steps(batches) -> dict[str, torch.Tensor]:
    """One AdamW step with clipping per batch of sequences, in one process (workers.adamw_steps' math)."""
    model = build_qwen2("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for seqs in batches:
        opt.zero_grad(set_to_none=True)
        token_mean_loss(model, seqs, workers.count_targets(seqs), world_size=1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_twenty_alternating_failed_and_good_minibatches_train_as_the_good_ones_and_leak_nothing():
    batches, failures = [], []
    for k in range(10):
        seqs = workers.make_sequences(6, seed=40 + k)
        batches.append((seqs, random_plan(len(seqs), [2, 2, 2], seed=40 + k)))
        failures.append((k % WORLD, failure_workers.WHERE[k % len(failure_workers.WHERE)]))
    results = run_ranks(failure_workers.alternating, WORLD, batches, failures)
    expected = reference_steps([seqs for seqs, _ in batches])
    worst = 0.0
    for rank, r in enumerate(results):
        for (outcome, elapsed), (culprit, where) in zip(r["failed"], failures):
            assert outcome == _error(rank, culprit, where), (rank, outcome)
            assert elapsed < WAIT_BOUND_S, (rank, where, elapsed)
            worst = max(worst, elapsed)
        print(f"rank {rank}: {assert_weights_agree(r['params'], expected, 1e-5, f'rank {rank}')}")
        second, last = r["resources"]["second"], r["resources"]["last"]
        assert last["fds"] == second["fds"] and last["shm_maps"] == second["shm_maps"], (second, last)
        assert last["shm_files"] == [], last["shm_files"]
        growth = (last["rss"] - second["rss"]) / 2**20
        print(f"rank {rank}: resident memory {growth:+.1f} MiB over 8 failed and 8 good mini-batches")
        assert growth < 8, growth
    print(f"10 failed mini-batches (every place, every rank the culprit in turn): slowest rank failed in {worst:.2f} s")


def test_hsdp_one_rank_of_one_node_fails_all_four_at_once_and_the_retry_equals_one_process():
    failed_seqs = workers.make_sequences(10, seed=31)
    failed = (failed_seqs, random_plan(len(failed_seqs), [2, 1, 2, 3], seed=31))
    retried_seqs = workers.make_sequences(10, seed=32)
    retried = (retried_seqs, random_plan(len(retried_seqs), [3, 0, 1, 2], seed=32))
    culprit, where = 3, "after_first_backward"
    results = run_ranks(failure_workers.hsdp_retry_after_failure, 4, failed, retried, culprit, where)
    _check_failed(results, culprit, where)
    expected = reference_train_steps(retried_seqs, 1)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {assert_weights_agree(r['params'], expected, 1e-5, f'rank {rank}')}")
    print(f"HSDP: every rank of both nodes failed within {max(r['elapsed'] for r in results):.2f} s naming rank 3")


def test_a_call_rejected_for_misuse_changes_nothing_and_the_minibatch_in_flight_completes():
    """3 shm ranks: end() without begin(), then, mid-mini-batch on rank 1, begin() twice and a backward
    mini-batch of a forward-only model, each refused; the mini-batch in flight completes on every rank with
    one process's gradients. A model closed refuses begin()."""
    seqs = workers.make_sequences(9, seed=31)
    plan = random_plan(len(seqs), [2, 3, 1], seed=31)
    results = run_ranks(failure_workers.misuse_in_flight, WORLD, seqs, plan)
    expected = test_odc_core.reference_grads(seqs)
    for rank, (refused, grads) in enumerate(results):
        assert refused["end_without_begin"] == "RuntimeError: ODC end() called without begin()", refused
        assert refused["begin_after_close"].startswith("RuntimeError: ODC was closed"), refused
        if rank == 1:
            assert refused["begin_twice"].startswith("RuntimeError: ODC begin() called twice"), refused
            assert refused["backward_on_forward_only"].startswith("ValueError: this model was set up forward-only")
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
        assert grads.keys() == expected.keys()


def test_after_a_timeout_the_next_call_raises_the_timeouts_type():
    """Rank 2 never begins: ranks 0 and 1 time out waiting for its shards, and their next begin() raises an
    ODCTimeoutError (so an ODCError) carrying the original message, where it raised a bare RuntimeError."""
    seqs = workers.make_sequences(6, seed=32)
    plan = random_plan(len(seqs), [2, 2, 0], seed=32)
    results = run_ranks(failure_workers.next_call_after_timeout, WORLD, seqs, plan)
    for rank in (0, 1):
        first, second, message = results[rank]
        assert first[:3] == ["ODCTimeoutError", "ODCError", "RuntimeError"], first
        assert second[:3] == ["ODCTimeoutError", "ODCError", "RuntimeError"], second
        assert message.startswith("ODC cannot run another mini-batch: mini-batch 1 timed out"), message
        assert f"rank {rank}: waited 1s for mini-batch 1 shards; rank 2 did not get there" in message, message


def test_a_refused_apply_odc_leaves_nothing_and_a_model_with_every_parameter_frozen_needs_no_accumulator():
    seqs = workers.make_sequences(6, seed=33)
    plan = random_plan(len(seqs), [2, 1], seed=33)
    results = run_ranks(failure_workers.refused_setup_then_retry, 2, seqs, plan)
    expected = test_odc_core.reference_grads(seqs)
    for rank, (refusal, left, grads, accumulator) in enumerate(results):
        assert refusal == "TypeError: apply_odc's config must be an ODCConfig, got dict", rank
        assert left == 0, rank
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
        assert accumulator == 0, rank


@pytest.mark.parametrize(
    "options,error",
    [
        ({"trains": "no"}, "ODCConfig.trains must be True or False, got 'no'"),
        ({"lockstep": 1}, "ODCConfig.lockstep must be True or False, got 1"),
        ({"barrier_timeout_s": True}, "ODCConfig.barrier_timeout_s must be a finite number > 0, got True"),
        ({"barrier_timeout_s": "10"}, "ODCConfig.barrier_timeout_s must be a finite number > 0, got '10'"),
        ({"barrier_timeout_s": float("inf")}, "ODCConfig.barrier_timeout_s must be a finite number > 0, got inf"),
        (
            {"gradient_divide_factor": float("inf")},
            "ODCConfig.gradient_divide_factor must be a finite number > 0 or None, got inf",
        ),
    ],
)
def test_a_config_of_the_wrong_type_or_value_is_refused_naming_the_field(options, error):
    from odc_plugin.fsdp import ODCConfig

    with pytest.raises((TypeError, ValueError)) as refused:
        ODCConfig(**options)
    assert str(refused.value) == error


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_a_rank_out_of_memory_in_a_build_fails_every_rank_at_once_and_a_retry_equals_one_process(device):
    """3 ranks, shm on CPU and cuda_ipc on GPUs: after a release, rank 1 runs out of memory building the
    regions again, at the first region and at the last; every rank fails within 5 s naming rank 1, holds
    no region after it, and a retry builds and trains as one process on that mini-batch alone."""
    seqs = workers.make_sequences(9, seed=23)
    retried = (seqs, random_plan(len(seqs), [2, 3, 1], seed=23))
    results = run_ranks(failure_workers.failed_builds_then_retry, WORLD, retried, CULPRIT, device, timeout_s=300)
    expected = reference_train_steps(seqs, 1, device)
    for k, region in enumerate(failure_workers.BUILD_FAILS_AT):
        own = f"MemoryError: {failure_workers.INJECTED}: out of memory allocating '{region}' on rank {CULPRIT}"
        for rank, r in enumerate(results):
            outcome, elapsed, held = r["failures"][k]
            peer = f"ODCPeerFailedError: rank {rank}: rank {CULPRIT} failed in its mini-batch: {own}"
            assert outcome == (own if rank == CULPRIT else peer), (rank, outcome)
            assert elapsed < WAIT_BOUND_S and held == 0, (rank, region, elapsed, held)
        print(f"{device}, '{region}': every rank failed within {max(r['failures'][k][1] for r in results):.2f} s")
    for rank, r in enumerate(results):
        print(f"rank {rank}: {assert_weights_agree(r['params'], expected, 1e-5, f'rank {rank}')}")
