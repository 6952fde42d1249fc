"""LB-Micro is verl's own behaviour: its partition, and its micro-batches under a real data-parallel group."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions, rearrange_micro_batches

from odc_plugin.balance import lb_micro, rl_math_like, verl_rank_partition
from odc_plugin.launch import run_ranks

from .verl_ranks import rearrange_on_rank


@st.composite
def minibatches(draw):
    dp_size = draw(st.integers(1, 6))
    per_rank = draw(st.integers(1, 8))
    max_token_len = draw(st.integers(1, 4000))
    lens = draw(st.lists(st.integers(0, max_token_len), min_size=dp_size * per_rank, max_size=dp_size * per_rank))
    return lens, dp_size, max_token_len


@settings(max_examples=60, deadline=None)
@given(minibatches())
def test_equal_shares_same_micro_batch_count_within_budget(case):
    lens, dp_size, max_token_len = case
    plan = lb_micro(lens, dp_size, max_token_len)
    assert len(plan) == dp_size
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lens)))
    assert len({sum(map(len, rank)) for rank in plan}) == 1
    assert len({len(rank) for rank in plan}) == 1
    assert all(mb and sum(lens[i] for i in mb) <= max_token_len for rank in plan for mb in rank)
    # The rank shares are verl's equal-size workload partition.
    workloads = calculate_workload(torch.tensor(lens)).tolist()
    expected = get_seqlen_balanced_partitions(workloads, dp_size, equal_size=True)
    assert [sorted(i for mb in rank for i in mb) for rank in plan] == expected


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4000).flatmap(lambda L: st.tuples(st.lists(st.integers(1, L), min_size=1, max_size=40), st.just(L)))
)
def test_one_rank_is_rearrange_micro_batches(case):
    lens, max_token_len = case
    mask = (torch.arange(max(lens)) < torch.tensor(lens)[:, None]).long()
    batch = TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(lens)])
    _, expected = rearrange_micro_batches(batch, max_token_len=max_token_len)
    assert lb_micro(lens, 1, max_token_len) == [expected]


def test_matches_rearrange_micro_batches_over_a_gloo_group():
    """Three ranks all-reduce their micro-batch count as verl does; lb_micro replays that without a group."""
    world = 3
    rng = random.Random(0)
    cases, expected = [], []
    for seed, (per_rank, max_token_len) in enumerate([(4, 4608), (8, 6000), (8, 16384), (16, 5000), (6, 9000)]):
        # A small budget against long-tailed lengths makes ranks want different counts and retry over the limit.
        lens = rl_math_like(world * per_rank, seed=seed).total
        rng.shuffle(lens)
        plan = lb_micro(lens, world, max_token_len)
        ranks = [sorted(i for mb in rank for i in mb) for rank in plan]
        cases.append(([[lens[i] for i in rank] for rank in ranks], max_token_len))
        expected.append(plan)
    results = run_ranks(rearrange_on_rank, world, cases, timeout_s=300)
    for c, plan in enumerate(expected):
        ranks = [sorted(i for mb in rank for i in mb) for rank in plan]
        got = [[[ranks[r][i] for i in mb] for mb in results[r][c]] for r in range(world)]
        assert got == plan, c
    # In some case the ranks alone would pick different counts, so the shared count is really negotiated.
    assert any(len({len(lb_micro(lens, 1, budget)[0]) for lens in per_rank}) > 1 for per_rank, budget in cases)


def test_fixed_micro_batch_size_cuts_verls_shares_in_order():
    """Without dynamic batch size verl's prepare_micro_batches cuts each rank's share into equal pieces."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    lens = rl_math_like(24, seed=3).total
    plan = lb_micro(lens, 3, 16384, micro_batch_size=4)
    for rank, share in zip(plan, verl_rank_partition(lens, 3)):
        data = TensorDict({"position": torch.tensor(share)}, batch_size=[len(share)])
        tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
        micro_batches, _ = prepare_micro_batches(data)
        assert rank == [mb["position"].tolist() for mb in micro_batches]
    with pytest.raises(ValueError, match="each rank's 8 samples into micro-batches of micro_batch_size samples"):
        lb_micro(lens, 3, 16384, micro_batch_size=3)


@pytest.mark.parametrize(
    "lens,dp_size,match",
    [
        ([1, 2, 3], 2, "3 samples do not divide over 2 ranks"),
        ([1], 2, "1 samples do not divide over 2 ranks"),
        ([1, 20], 2, "sample 1 has 20 tokens, more than max_token_len=10"),
    ],
)
def test_bad_inputs(lens, dp_size, match):
    with pytest.raises(ValueError, match=match):
        lb_micro(lens, dp_size, 10)
