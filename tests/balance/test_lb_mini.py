"""LB-Mini: plan invariants (hypothesis), input errors, and balance against verl's equal-size partition."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_plugin.balance import (
    FitCost,
    balance_efficiency,
    get_cost_model,
    lb_mini,
    rl_math_like,
    sft_long_context_like,
    verl_rank_partition,
)

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
    costs = get_cost_model(cost).costs(lens)
    for rank in plan:
        assert all(mb and sum(lens[i] for i in mb) <= max_token_len for mb in rank)
        mb_costs = [sum(costs[i] for i in mb) for mb in rank]
        assert mb_costs == sorted(mb_costs, reverse=True)


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


def test_a_rank_packs_first_fit_decreasing_costliest_first():
    # Lengths 6, 4 | 5, 3, 2 fill two micro-batches of 10; under tokens they tie, so the lowest index leads.
    assert lb_mini([2, 3, 4, 5, 6], 1, 10) == [[[3, 1, 0], [4, 2]]]
    # Under a quadratic cost 6 + 4 (52) outweighs 5 + 3 + 2 (38).
    assert lb_mini([2, 3, 4, 5, 6], 1, 10, cost=FitCost(a=1, b=0)) == [[[4, 2], [3, 1, 0]]]


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
