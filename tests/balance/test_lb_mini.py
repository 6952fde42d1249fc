"""LB-Mini: plan invariants (hypothesis), input errors, balance against verl's equal-size partition, its
Karmarkar-Karp against verl's, and its micro-batches against the packing verl's engine runs."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import karmarkar_karp
from verl.workers.engine.utils import prepare_micro_batches

from odc_plugin.balance import (
    FitCost,
    balance_efficiency,
    get_cost_model,
    lb_mini,
    rl_math_like,
    sft_long_context_like,
    verl_rank_partition,
)
from odc_plugin.balance.lb_mini import _largest_differencing

COSTS = ["tokens", "flops", FitCost(a=1e-3, b=1.0)]


@st.composite
def minibatches(draw, grouped: bool = False):
    max_token_len = draw(st.integers(1, 5000))
    n = draw(st.integers(0, 60))
    lens = draw(st.lists(st.integers(0, max_token_len), min_size=n, max_size=n))
    dp_size = draw(st.integers(1, 10))
    groups = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n)) if grouped else None
    return lens, dp_size, max_token_len, draw(st.sampled_from(COSTS)), groups


def check_plan(plan, lens, dp_size, max_token_len, cost):
    assert len(plan) == dp_size
    flat = sorted(i for rank in plan for mb in rank for i in mb)
    assert flat == list(range(len(lens)))
    for rank in plan:
        assert all(mb and sum(lens[i] for i in mb) <= max_token_len for mb in rank)


@settings(max_examples=150, deadline=None)
@given(minibatches())
def test_plan_invariants(case):
    lens, dp_size, max_token_len, cost, _ = case
    plan = lb_mini(lens, dp_size, max_token_len, cost=cost)
    check_plan(plan, lens, dp_size, max_token_len, cost)
    assert plan == lb_mini(list(lens), dp_size, max_token_len, cost=cost)
    assert sum(1 for rank in plan if rank) <= len(lens)


@settings(max_examples=100, deadline=None)
@given(minibatches(grouped=True))
def test_groups_stay_on_one_rank(case):
    lens, dp_size, max_token_len, cost, groups = case
    plan = lb_mini(lens, dp_size, max_token_len, cost=cost, group_ids=groups)
    check_plan(plan, lens, dp_size, max_token_len, cost)
    rank_of = {i: r for r, rank in enumerate(plan) for mb in rank for i in mb}
    for g in set(groups):
        assert len({rank_of[i] for i, gi in enumerate(groups) if gi == g}) == 1


def test_fewer_samples_than_ranks_leaves_ranks_empty():
    plan = lb_mini([5, 7], 4, 10)
    assert sorted(plan) == [[], [], [[0]], [[1]]]
    assert lb_mini([], 3, 10) == [[], [], []]


def _engine_micro_batches(lens: list[int], max_token_len: int) -> list[list[int]]:
    """What the ODC engine runs on a rank holding these samples (ODCEngine._micro_batches with dynamic batch
    size): verl's prepare_micro_batches on the rank's remove-padding batch, not agreeing on the count."""
    offsets = torch.tensor([0, *lens]).cumsum(0)
    input_ids = torch.nested.nested_tensor_from_jagged(torch.zeros(int(offsets[-1]), dtype=torch.long), offsets)
    data = TensorDict({"input_ids": input_ids}, batch_size=[len(lens)])
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len, sp_size=1)
    _, indices = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=False)
    return indices


def test_each_rank_packs_as_the_odc_engine_runs_it():
    """A plan's micro-batches are the ones the engine will run for the rank's samples, in its order."""
    for seed, (dp_size, per_rank, max_token_len) in enumerate([(4, 6, 8192), (8, 16, 16384), (2, 24, 20000)]):
        lens = rl_math_like(dp_size * per_rank, seed=seed).total
        plan = lb_mini(lens, dp_size, max_token_len, cost="flops")
        assert sum(len(rank) for rank in plan) > dp_size  # several micro-batches on some rank
        for rank in plan:
            share = sorted(i for mb in rank for i in mb)  # what the dispatch sends: the rank's samples in order
            expected = _engine_micro_batches([lens[i] for i in share], max_token_len)
            assert rank == [[share[i] for i in mb] for mb in expected]


def test_karmarkar_karp_is_verls():
    """The differencing starts give the parts of verl's karmarkar_karp (equal_size=False for single units,
    equal_size=True for runs of dp_size, where verl needs the count padded to a multiple)."""
    for seed in range(100):
        rng = random.Random(seed)
        n, k = rng.randint(1, 80), rng.randint(1, 12)
        weights = [rng.uniform(1, 1000) for _ in range(n)]  # distinct: the two break ties differently
        ours = [_largest_differencing(weights, k, chunk) for chunk in (1, k)]
        padded = weights + [0.0] * (-n % k)
        verls = [karmarkar_karp(weights, k, equal_size=False), karmarkar_karp(padded, k, equal_size=True)]
        for mine, theirs in zip(ours, verls):
            assert sorted(map(sorted, mine)) == sorted(sorted(i for i in part if i < n) for part in theirs)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (([1, 20, 3], 2, 10), {}, r"^sample 1 has 20 tokens, more than max_token_len=10$"),
        (([1, 2], 0, 10), {}, r"dp_size must be an integer >= 1, got 0"),
        (([1, 2], 2.5, 10), {}, r"dp_size must be an integer >= 1, got 2.5"),
        (([1, 2], 2, 0), {}, r"max_token_len must be an integer >= 1, got 0"),
        (([1, -2], 2, 10), {}, r"sequence length of sample 1 must be a non-negative integer, got -2"),
        (([1, 2], 2, 10), {"group_ids": [0]}, r"group_ids has 1 entries for 2 samples"),
        (([1, 2], 2, 10), {"cost": "bogus"}, r"unknown cost model 'bogus'"),
    ],
)
def test_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        lb_mini(*args, **kwargs)
    assert "\n" not in str(err.value)


def test_balance_efficiency():
    assert balance_efficiency([[3], [1, 2]]) == 1.0
    assert balance_efficiency([[0], [1, 2]], costs=[3, 1, 2]) == 1.0
    assert balance_efficiency([[[0, 1]], [[2]]], costs=[1, 1, 1]) == pytest.approx(1.5 / 2)
    assert balance_efficiency([[8], [1], []]) == 1.0  # the largest sample is the limit
    assert balance_efficiency([[], []]) == 1.0
    with pytest.raises(ValueError, match="at least one rank"):
        balance_efficiency([])


@pytest.mark.parametrize("cost", ["tokens", "flops"])
@pytest.mark.parametrize("dp_size,per_rank", [(4, 4), (8, 4), (16, 8), (64, 4)])
def test_rl_like_draws_balance_well_and_never_worse_than_verl(cost, dp_size, per_rank):
    model = get_cost_model(cost)
    effs = []
    for seed in range(100):
        lens = rl_math_like(dp_size * per_rank, seed=seed).total
        costs = model.costs(lens)
        eff = balance_efficiency(lb_mini(lens, dp_size, 16384, cost=model), costs)
        assert eff >= balance_efficiency(verl_rank_partition(lens, dp_size), costs), seed
        effs.append(eff)
    assert statistics.fmean(effs) >= 0.98


def test_sft_like_draws_never_worse_than_verl():
    for seed in range(30):
        lens = sft_long_context_like(64, seed=seed).total
        costs = get_cost_model("flops").costs(lens)
        eff = balance_efficiency(lb_mini(lens, 8, 32768, cost="flops"), costs)
        assert eff >= balance_efficiency(verl_rank_partition(lens, 8), costs), seed


def test_a_baseline_split_is_kept_unless_lb_mini_predicts_a_real_gain():
    lens = [100, 101, 102, 103]  # the equal split [0, 3] / [1, 2] is within 0.5% of perfect
    equal = [[[0], [3]], [[2, 1]]]
    assert lb_mini(lens, 2, 1000, baseline=equal) == equal  # kept as it is, micro-batches and all
    skewed = [[[0, 1, 2]], [[3]]]  # 3x as much on rank 0: LB-Mini's own split wins
    plan = lb_mini(lens, 2, 1000, baseline=skewed)
    assert sorted(len([i for mb in rank for i in mb]) for rank in plan) == [2, 2]
    with pytest.raises(ValueError, match="the baseline plan must give each of the 4 samples"):
        lb_mini(lens, 2, 1000, baseline=[[[0, 1]], [[2]]])
