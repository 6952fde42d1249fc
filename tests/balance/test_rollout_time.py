"""The decode model of a GPU inference server (odc_plugin/balance/rollout_time.py), against times worked out
by hand, and the shipped fit file against the published figures it is derived from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from odc_plugin.balance.rollout_time import DecodeClock, DecodeModel, rollout_seconds

FIT = Path(__file__).parents[2] / "configs" / "cost_fit" / "Qwen2.5-7B-H100-decode.json"

# weights read in 1 s, a token of context in 1 ms, a token computed in 0.1 s (prefill and decode)
TOY = DecodeModel(weight_bytes=1000, kv_bytes_per_token=1, flops_per_token=100, memory_bw=1000, flops=1000)


def test_one_request_pays_its_prefill_and_a_weight_read_per_token():
    # prefill 2 tokens: 0.2 s; 3 decode steps over contexts 2, 3, 4: 1.002 + 1.003 + 1.004
    assert rollout_seconds([2], [3], TOY).seconds == pytest.approx(0.2 + 3.009)


def test_a_step_is_bound_by_memory_or_by_compute_whichever_is_slower():
    assert TOY.step_seconds(1, 0) == pytest.approx(1.0)  # memory: the weights
    assert TOY.step_seconds(20, 0) == pytest.approx(2.0)  # compute: 20 tokens at 0.1 s
    assert TOY.step_seconds(1, 500) == pytest.approx(1.5)  # memory: weights and 500 tokens of context


def test_the_long_tail_runs_alone_and_max_running_queues_the_rest():
    """Batched, the short responses share the weight reads; the longest then runs alone to its end. With
    one sequence at a time (max_running=1) each waits for those before it."""
    batched = rollout_seconds([0, 0, 0], [1, 1, 10], TOY)
    assert batched.finished_s[0] == batched.finished_s[1] == pytest.approx(1.0)  # one step, no context yet
    assert batched.seconds == pytest.approx(1.0 + sum(1 + c / 1000 for c in range(1, 10)))  # then alone
    assert batched.until(2) == pytest.approx(1.0)
    serial = rollout_seconds([0, 0, 0], [1, 1, 10], DecodeModel(**{**TOY.__dict__, "max_running": 1}))
    assert serial.finished_s[:2] == pytest.approx((1.0, 2.0))
    assert serial.seconds == pytest.approx(2.0 + sum(1 + c / 1000 for c in range(10)))
    with pytest.raises(ValueError, match="count must be 1..3"):
        batched.until(4)


def test_servers_share_the_requests_round_robin():
    one = rollout_seconds([0] * 4, [5, 5, 5, 5], TOY)
    two = rollout_seconds([0] * 4, [5, 5, 5, 5], TOY, servers=2)
    assert two.seconds < one.seconds  # fewer contexts to read per step on each server


def test_a_request_arriving_later_starts_with_the_next_step():
    clock = DecodeClock(TOY)
    first = clock.admit(0, 3)
    clock.advance(1.5)  # the first step ends at 1.0, the second would end at 2.001
    assert clock.now == pytest.approx(1.0) and clock.finished(first) is None
    second = clock.admit(0, 1)
    clock.advance(10.0)
    assert clock.finished(second) == pytest.approx(1.0 + 1.001)  # joined the second step
    assert clock.finished(first) == pytest.approx(1.0 + 1.001 + 1.002)
    assert clock.now == 10.0  # idle: its clock moves on
    with pytest.raises(ValueError, match="request needs"):
        clock.admit(0, 0)


def test_the_shipped_fit_is_what_its_sources_give():
    """Qwen2.5-7B in bf16 on an H100 SXM: one sequence decodes at the published 77% of the memory ceiling
    (about 170 tokens/s), a full batch at 5k tokens of context some 7,000 tokens/s."""
    model = DecodeModel.load(FIT)
    assert set(json.loads(FIT.read_text())["sources"]) <= set(model.__dict__)
    assert model.memory_bw == pytest.approx(0.77 * 3.35e12, rel=1e-3)
    assert model.kv_bytes_per_token == 28 * 2 * 4 * 128 * 2
    assert 160 < 1 / model.step_seconds(1, 1000) < 175
    assert 7000 < 256 / model.step_seconds(256, 256 * 5000) < 8000
    assert DecodeModel.load(FIT, max_running=64).max_running == 64
    with pytest.raises(ValueError, match="not a decode fit file"):
        DecodeModel.load(Path(__file__))


def test_a_rollout_that_never_runs_dry_pays_no_tail():
    """Full batches all along: the tokens at the full batch's rate, at the mean context a running sequence
    is met at; shorter than a synchronous rollout of a long-tailed batch, which ends with its tail alone."""
    from odc_plugin.balance.rollout_time import steady_seconds

    # 2 responses of 10 tokens: running 2, context 10 * 10 * 2 / (2 * 20) = 5 a sequence: a step 1.01 s
    assert steady_seconds([0, 0], [10, 10], TOY) == pytest.approx(20 / (2 / 1.010))
    model = DecodeModel.load(FIT)
    prompts, responses = [200] * 64, [1000] * 56 + [16000] * 8
    assert steady_seconds(prompts, responses, model) < 0.5 * rollout_seconds(prompts, responses, model).seconds
