"""LB-Mini with its longest samples split over Ulysses groups (issue 47): the plan's invariants, that it wins
where one sample outweighs a rank's share and declines where splitting does not pay, its limit, and its row
in odc-plan."""

from __future__ import annotations

import json
import random

import pytest

from odc_plugin.balance import get_cost_model, lb_mini, rl_math_like, sft_long_context_like
from odc_plugin.balance.common import minibatch_limit
from odc_plugin.balance.lb_mini import MIN_GAIN
from odc_plugin.balance.lengths import RL_PROFILE
from odc_plugin.balance.planner import main
from odc_plugin.balance.split import Split, SplitPlan, UlyssesModel, heads_limit, lb_mini_split, split_limit
from odc_plugin.balance.step_time import SPLIT_SCHEME, StepTimeModel, compare_schemes, simulate_split

MODEL = "Qwen2.5-7B"  # 28 heads, 4 kv heads: groups of at most 4
H100 = StepTimeModel(throughput=4e14)


def check_plan(plan: SplitPlan, num_samples: int, dp_size: int, max_group: int) -> None:
    """Every sample once, split or in one rank's micro-batches; each group an aligned power-of-two block of
    ranks, 2 to max_group of them."""
    placed = [s.sample for s in plan.splits] + [i for rank in plan.ranks for mb in rank for i in mb]
    assert sorted(placed) == list(range(num_samples))
    assert len(plan.ranks) == dp_size
    for s in plan.splits:
        assert 2 <= s.k <= max_group and s.k & (s.k - 1) == 0
        assert s.first % s.k == 0 and s.first + s.k <= dp_size


def test_heads_limit_and_the_all_to_all_model():
    assert heads_limit(28, 4, 8) == 4  # Qwen2.5-7B: 28 heads divide over 4, not 8
    assert heads_limit(32, 8, 8) == 8 and heads_limit(32, 8, 4) == 4  # a node's GPUs cap it
    assert heads_limit(14, 2, 8) == 2 and heads_limit(12, 2, 8) == 4  # kv heads repeated over a larger group
    ulysses = UlyssesModel.from_config(MODEL)
    assert ulysses.max_group == 4 and ulysses.group_sizes(16) == [1, 2, 4] and ulysses.group_sizes(6) == [1, 2]
    assert ulysses.seconds(32768, 1) == 0
    # A 32k-token sample over 4 GPUs: some 20 ms of all-to-alls beside seconds of compute.
    assert 0.01 < ulysses.seconds(32768, 4) < 0.03 < get_cost_model("flops", model=MODEL)(32768) / 4 / 4e14 / 10
    with pytest.raises(ValueError, match="max_group must be a power of two"):
        UlyssesModel(max_group=3)
    # measured figures (odc-check's, through odc_split_bandwidth / odc_split_latency_s) replace the modelled
    # ones; None keeps them
    assert UlyssesModel.from_config(MODEL, bandwidth=None, latency_s=None) == ulysses
    measured = UlyssesModel.from_config(MODEL, bandwidth=ulysses.bandwidth / 2, latency_s=2 * ulysses.latency_s)
    assert (measured.bandwidth, measured.latency_s) == (ulysses.bandwidth / 2, 2 * ulysses.latency_s)
    assert measured.seconds(32768, 4) == pytest.approx(2 * ulysses.seconds(32768, 4))


@pytest.mark.parametrize("nodes, gpus_per_node", [(2, 6), (3, 4), (2, 8)])
def test_split_groups_never_span_two_nodes(nodes, gpus_per_node):
    """A model of 32 heads allows groups of 8; with 6 GPUs a node the aligned block of ranks 4-7 would span
    nodes 0 and 1, so groups there are of at most 2. One long sample a rank: the plan splits."""
    dp_size = nodes * gpus_per_node
    ulysses = UlyssesModel.from_config("Qwen3-8B", gpus_per_node)
    assert gpus_per_node % ulysses.max_group == 0
    cost = get_cost_model("flops", model="Qwen3-8B")
    splits = [
        s
        for seed in range(4)
        for s in lb_mini_split(
            sft_long_context_like(dp_size, seed=seed).total, dp_size, 65536, cost, ulysses=ulysses, throughput=4e14
        ).splits
    ]
    assert splits and max(s.k for s in splits) == ulysses.max_group
    assert all(s.first // gpus_per_node == (s.first + s.k - 1) // gpus_per_node for s in splits), splits


def test_lb_mini_balances_what_ranks_have_left():
    """rank_start: a rank busy for most of the mini-batch already gets only what fits beside it."""
    start = [0, 0, 0, 150]
    shares = [[i for mb in rank for i in mb] for rank in lb_mini([100] * 8, 4, 1000, rank_start=start)]
    assert len(shares[3]) <= 1 and max(t + 100 * len(share) for t, share in zip(start, shares)) == 300
    with pytest.raises(ValueError, match="rank_start needs 4 values >= 0"):
        lb_mini([1, 2], 4, 10, rank_start=[0, 0, -1, 0])


def test_simulated_split_runs_first_on_its_whole_group():
    ulysses = UlyssesModel(max_group=2, bytes_per_token=1e6, all_to_alls=4, bandwidth=1e9, latency_s=0.01)
    comm = 1000 * 1e6 / 2 / 2 / 1e9 + 4 * 0.01  # 1000 tokens over 2 ranks: each sends half of its half
    plan = SplitPlan((Split(0, 2, 0),), [[[1]], [[2]]])
    t = simulate_split(plan, [10.0, 3.0, 1.0], [1000, 300, 100], ulysses, slowdown=[1.0, 2.0])
    # The group runs at its slower member's pace (10 / 2 * 2) and both wait for the all-to-alls; then rank 0's
    # sample (3) outlasts rank 1's (1, 2x slower).
    assert t.seconds == pytest.approx(10 + comm + 3.0)
    assert t.idle_fraction == pytest.approx(1 - (5 + 10 + 3 + 2) / (2 * t.seconds))


def test_split_limit_without_splits_is_minibatch_limit():
    rng = random.Random(0)
    for _ in range(20):
        costs = [rng.uniform(0, 10) for _ in range(rng.randint(1, 12))]
        slowdown = [rng.uniform(1, 2) for _ in range(rng.randint(1, 8))]
        lens = [int(c * 100) for c in costs]
        limit = split_limit(costs, lens, slowdown, UlyssesModel(max_group=1), throughput=2.0)
        assert limit.seconds == pytest.approx(minibatch_limit(costs, slowdown, throughput=2.0))


def test_split_passes_the_longest_sample_one_per_rank():
    """16 ranks, one long-context SFT sample each: the longest sample is LB-Mini's step and its limit. Split
    over groups of up to 4 (what 28 heads allow), the step is at least 1.5x shorter and within 15% of the new
    limit."""
    ulysses, cost = UlyssesModel.from_config(MODEL), get_cost_model("flops", model=MODEL)
    for seed in range(6):
        lens = sft_long_context_like(16, seed=seed).total
        c = compare_schemes(lens, 16, 32768, cost, H100, ulysses=ulysses)
        mini, split = c.times["odc_lb_mini"].seconds, c.times[SPLIT_SCHEME].seconds
        over = split / c.split_limit.seconds - 1
        print(
            f"seed {seed}: LB-Mini {mini:.3f} s, split {split:.3f} s ({mini / split:.2f}x), split limit "
            f"{c.split_limit.seconds:.3f} s ({c.split_limit.bound} bound), {over:+.1%} over it"
        )
        assert mini / split >= 1.5 and over <= 0.15
        check_plan(lb_mini_split(lens, 16, 32768, cost, ulysses=ulysses, throughput=4e14), 16, 16, 4)


def test_split_declines_where_it_does_not_pay():
    """8 RL samples per rank at 16 ranks: LB-Mini is near its limit, so the plan never splits for less than
    MIN_GAIN and is never more than 1% slower than LB-Mini."""
    ulysses, cost = UlyssesModel.from_config(MODEL), get_cost_model("flops", model=MODEL)
    ratios = []
    for seed in range(8):
        lens = rl_math_like(128, seed=seed, **RL_PROFILE).total
        times = compare_schemes(lens, 16, 32768, cost, H100, ulysses=ulysses).times
        ratios.append(times[SPLIT_SCHEME].seconds / times["odc_lb_mini"].seconds)
        plan = lb_mini_split(lens, 16, 32768, cost, ulysses=ulysses, throughput=4e14)
        check_plan(plan, 128, 16, 4)
        assert not plan.splits or ratios[-1] <= 1 - MIN_GAIN
    print(f"split over LB-Mini, 8 RL samples per rank: {min(ratios):.4f}-{max(ratios):.4f}")
    assert max(ratios) <= 1.01


@pytest.mark.parametrize("dp_size, micro_batch_size", [(12, None), (8, 2), (16, None)])
def test_split_plans_keep_their_invariants(dp_size, micro_batch_size):
    """Rank counts that only some groups tile, fixed micro-batches, uneven rank speeds, a model of 32 heads."""
    ulysses, cost = UlyssesModel.from_config("Qwen3-8B"), get_cost_model("flops", model="Qwen3-8B")
    rng = random.Random(dp_size)
    for seed in range(4):
        lens = sft_long_context_like(2 * dp_size, seed=seed).total
        speeds = [rng.choice([1.0, 0.7]) for _ in range(dp_size)]
        plan = lb_mini_split(
            lens, dp_size, 32768, cost, ulysses=ulysses, rank_speed=speeds, micro_batch_size=micro_batch_size
        )
        check_plan(plan, len(lens), dp_size, max(ulysses.group_sizes(dp_size)))
        if micro_batch_size:
            assert all(len(mb) <= micro_batch_size for rank in plan.ranks for mb in rank)


def test_odc_plan_prints_the_split_row(capsys):
    args = ["--lengths", "sft", "--ranks", "16", "--minibatch-sizes", "16", "--draws", "2"]
    main(args)
    table = capsys.readouterr().out
    assert "ODC+LB-Mini+split" in table and "work bound" in table
    main([*args, "--json"])
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["speedup"][SPLIT_SCHEME] > 1.5 * row["speedup"]["odc_lb_mini"]
    assert row["seconds"][SPLIT_SCHEME] >= row["split_limit_s"] and 0 <= row["work_bound_share"] <= 1
