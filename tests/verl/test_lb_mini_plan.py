"""LB-Mini's plan of a batch, pure (odc_plugin/verl/dispatch.py): no trainer, no Ray, no ranks.

* verl's own steps: the samples every optimizer step trains on under fsdp2 (verl's chunks and iterator);
* the plan: every step's samples once, uneven counts, at least one sample per rank, verl's own pieces kept
  when LB-Mini predicts no gain, fixed micro-batch sizes, errors, determinism;
* the split of a batch's TransferQueue metadata by a plan: each sample once per rank, steps as indices;
* the settings a role gets from its engine config (which runs are ODC + LB-Mini) (the losses refused:
  tests/verl/test_loss_probe.py).

The dispatch through verl's trainer, Ray and ranks: test_lb_mini_dispatch.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_plugin.verl.dispatch import (
    PLAN_KEY,
    STEPS_KEY,
    PlanRequest,
    _fill_empty_ranks,
    lb_mini_settings,
    plan_metrics,
    plan_steps,
    split_by_plan,
    verl_steps,
)
from tests.verl.lb_mini_cases import DYNAMIC, check_plan, engine_config, in_order, kv_batch
from tests.verl.requires import needs_transfer_queue as needs_tq

# ---------------------------------------------------------------------------------------------
# verl's steps, and the plan
# ---------------------------------------------------------------------------------------------


@needs_tq
def test_verl_steps_are_the_mini_batches_verl_forms():
    batch = kv_batch([10] * 16, mini_batch_size=8, epochs=1, seed=7)
    assert verl_steps(batch, 2, update=True) == in_order(16, 2, 4)
    assert verl_steps(batch, 2, update=False) == [[list(range(8)), list(range(8, 16))]]  # forward only: the chunks
    batch.extra_info.update(epochs=3, dataloader_kwargs={"shuffle": True})
    steps = verl_steps(batch, 2, update=True)
    assert len(steps) == 6
    for epoch in range(3):
        # every epoch trains on every sample once; each rank only on its own chunk, reshuffled per epoch
        assert sorted(p for step in steps[2 * epoch : 2 * epoch + 2] for piece in step for p in piece) == list(
            range(16)
        )
        assert all(set(step[r]) <= set(range(8 * r, 8 * r + 8)) for step in steps for r in range(2))
    assert steps[:2] != steps[2:4] and steps == verl_steps(batch, 2, update=True)
    # ranks shuffle with seed + rank: their orders differ
    assert [p - 8 for p in steps[0][1]] != steps[0][0]
    del batch.extra_info["mini_batch_size"]
    batch.extra_info["num_mini_batch"] = 4
    assert len(verl_steps(batch, 2, update=True)) == 12
    with pytest.raises(ValueError, match="mini_batch_size=6 does not divide over 4 ranks"):
        verl_steps(kv_batch([10] * 16, mini_batch_size=6), 4, update=True)


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 4),
    per_rank=st.integers(1, 4),
    num_steps=st.integers(1, 3),
    data=st.data(),
)
def test_plan_covers_every_step_once_with_a_sample_per_rank(dp, per_rank, num_steps, data):
    n = dp * per_rank * num_steps
    lens = data.draw(st.lists(st.integers(1, 96), min_size=n, max_size=n))
    stock = in_order(n, dp, per_rank)
    plan = plan_steps(lens, stock, max_token_len=96)
    check_plan(plan, stock)
    assert plan == plan_steps(list(lens), stock, max_token_len=96)  # deterministic


def test_plan_counts_may_differ_and_beat_verls_pieces():
    # one long sequence per step: verl's equal pieces put it with as many samples as the others get
    lens = [60, 8, 8, 8, 8, 8, 8, 8] * 2
    stock = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]]
    plan = plan_steps(lens, stock, max_token_len=64)
    check_plan(plan, stock)
    assert all(sorted(map(len, step)) == [1, 7] for step in plan.steps)  # the 60-token sample alone
    # busiest rank: 60 tokens; verl's pieces put 60 + 3 * 8 = 84 on one rank
    assert all(max(sum(lens[p] for p in share) for share in step) == 60 for step in plan.steps)
    metrics = plan_metrics(plan, lens, "tokens", "odc_balance")
    assert metrics["odc_balance/samples_min"] < metrics["odc_balance/samples_max"]
    assert metrics["odc_balance/efficiency"] == pytest.approx(1.0)
    assert metrics["odc_balance/mini_batches"] == 2


def test_plan_keeps_verls_pieces_sample_for_sample_when_no_split_is_faster():
    lens = [30, 10, 20, 20, 10, 30, 20, 20]
    stock = [[[5, 1, 3, 2], [0, 4, 7, 6]]]  # shuffled pieces: their order is kept too
    assert plan_steps(lens, stock, max_token_len=64).steps == ((tuple(stock[0][0]), tuple(stock[0][1])),)


def test_plan_with_odc_split_splits_the_longest_sample_and_runs_it_first_on_its_group():
    """One sample outweighs a rank's share: split over the aligned groups allowed, first on every member;
    without a UlyssesModel (odc_split=off) the same call plans exactly as before."""
    from odc_plugin.balance.split import UlyssesModel

    lens = [16, 60, 2, 3, 4, 5, 6, 4]  # 100 tokens over 4 ranks; the 60-token sample alone is 60
    stock = [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    ulysses = UlyssesModel(max_group=4)
    plan = plan_steps(lens, stock, max_token_len=64, ulysses=ulysses)
    assert plan_steps(lens, stock, max_token_len=64).splits == ()
    longest = plan.splits[0][0]
    assert (longest.sample, longest.k, list(longest.group)) == (1, 4, [0, 1, 2, 3])
    split = [s.sample for s in plan.splits[0]]
    assert sorted(split + [p for share in plan.steps[0] for p in share]) == list(range(8))  # each sample once
    for rank in range(4):
        positions, groups = plan.split_share(0, rank)
        mine = [s for s in plan.splits[0] if rank in s.group]
        assert positions == [s.sample for s in mine] + list(plan.steps[0][rank])  # split samples first, in order
        assert groups == [list(s.group) for s in mine]
        assert plan.micro_batches[0][rank] == len(mine) + (1 if plan.steps[0][rank] else 0)
    metrics = plan_metrics(plan, lens, "tokens", "odc_balance")
    assert metrics["odc_balance/unsplit_predicted_s"] == 60  # LB-Mini alone: the 60-token sample is the step
    assert metrics["odc_balance/split_predicted_s"] < 0.5 * 60
    # a k-th of each split sample's tokens on each member of its group (SFT's slowest_rank_tokens counts them so)
    assert metrics["odc_balance/max"] == pytest.approx(metrics["odc_balance/split_predicted_s"])
    assert sum(sum(plan.rank_items(0, rank, lens)) for rank in range(4)) == pytest.approx(sum(lens))
    # declined where nothing outweighs a rank's share: LB-Mini's plan, predicted the same both ways
    even = plan_steps([10] * 8, stock, max_token_len=64, ulysses=ulysses)
    assert even.splits == ((),) and even.predicted[0][0] == even.predicted[0][1]


def test_a_static_cost_prices_the_all_to_alls_with_the_throughput_its_engine_measured():
    """With the tokens cost the all-to-alls (seconds) are priced in tokens by the throughput the engine
    measured in the role's last update (its tokens over its ranks' compute seconds); before that update they
    are left out and the predictions named by their unit (`*_predicted_cost`)."""
    from odc_plugin.balance.costs import get_cost_model
    from odc_plugin.balance.split import UlyssesModel
    from odc_plugin.verl.dispatch import LBMiniSettings

    lens = [16, 60, 2, 3, 4, 5, 6, 4]
    stock = [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    # every split costs 8 all-to-alls of 1 ms: 8 ms, 80 tokens at 10,000 tokens/s, 0.8 at 100
    ulysses = UlyssesModel(max_group=4, all_to_alls=8, latency_s=1e-3)
    settings = LBMiniSettings(get_cost_model("tokens"), 64, None, ulysses=ulysses)
    first, _ = settings.plan(lens, stock)
    assert first.splits[0] and not first.predicted_in_seconds  # nothing measured: all-to-alls left out
    metrics = plan_metrics(first, lens, "tokens", "odc_balance")
    assert metrics["odc_balance/unsplit_predicted_cost"] == 60 and "odc_balance/split_predicted_s" not in metrics
    # the update ran its 100 tokens in 0.25 s of compute a rank on 4 ranks: 100 tokens/s
    observed = settings.observe({"actor/odc/compute_s_mean": 0.25}, "actor/", first, lens)
    assert observed == {"cost_per_s": pytest.approx(100.0)}
    slow, _ = settings.plan(lens, stock)
    assert slow.splits[0] and slow.predicted[0][1] == pytest.approx(60 / 100)  # LB-Mini's 60 tokens, in seconds
    assert slow.predicted[0][0] > first.predicted[0][0] / 100  # the all-to-alls' 8 ms counted
    settings.measured_throughput = 10_000.0  # 80 tokens of all-to-alls: splitting the 60-token sample loses
    fast, _ = settings.plan(lens, stock)
    assert fast.splits == ((),) and fast.predicted[0] == pytest.approx((60 / 10_000, 60 / 10_000))
    assert settings.for_inference(64, None, ulysses).throughput == 10_000.0  # a forward pass: the role's
    # an auto fit of another mesh (8 ranks' speeds) is not used on 4: the static cost plans, at its own throughput
    from odc_plugin.balance.online_fit import TimeFit

    settings.fit = TimeFit(a=0.0, b=1.0, c=0.0, speeds=(1.0,) * 8, timings=8)
    other, fit = settings.plan(lens, stock)
    assert fit is None and other.predicted == fast.predicted


def test_fill_empty_ranks_takes_the_cheapest_sample_of_the_fullest_rank():
    shares = [[0, 1, 2], [], [3, 4], []]
    _fill_empty_ranks(shares, [5.0, 1.0, 3.0, 0.5, 9.0])
    # rank 0 (3 samples) gives its cheapest (1); then ranks 0 and 2 tie at 2 and the lower rank gives
    assert shares == [[0], [1], [3, 4], [2]]


def test_plan_fixed_micro_batch_size_and_flops_cost():
    """With verl's fixed micro-batch size a share is cut into pieces of that size and a smaller last one:
    LB-Mini counts a rank's micro-batches so, whatever their tokens."""
    from odc_plugin.balance import get_cost_model

    lens = [10, 200, 30, 40, 50, 60, 20, 20]
    model = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    stock = in_order(8, 2, 4)
    plan = plan_steps(lens, stock, max_token_len=None, micro_batch_size=2, cost=get_cost_model("flops", model=model))
    check_plan(plan, stock)
    assert sorted(map(len, plan.steps[0])) == [1, 7]  # the 200-token sample alone, no token budget to respect
    assert plan.micro_batches[0] == tuple(-(-len(share) // 2) for share in plan.steps[0])


@pytest.mark.parametrize(
    ("stock", "kwargs", "match"),
    [
        ([[[0, 1], []]], {"max_token_len": 64}, "leaves one of 2 data-parallel ranks without a sample"),
        ([[[0], [1]]], {"max_token_len": 5}, "more than the per-micro-batch budget"),
        ([[[0], [1]]], {"max_token_len": None}, "give max_token_len"),
        ([[[0], [1]]], {"max_token_len": None, "micro_batch_size": 0}, "micro_batch_size must be an integer >= 1"),
    ],
)
def test_plan_errors(stock, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_steps([10, 10], stock, **kwargs)


# ---------------------------------------------------------------------------------------------
# which roles use LB-Mini
# ---------------------------------------------------------------------------------------------


def test_settings_only_for_odc_with_lb_mini():
    kw = {"use_dynamic_bsz": True, "max_token_len": 64, "micro_batch_size": None}
    assert lb_mini_settings(engine_config("fsdp2"), **kw) is None
    assert lb_mini_settings(engine_config("fsdp"), **kw) is None
    assert lb_mini_settings(engine_config("odc", odc_balancer="lb_micro"), **kw) is None
    # a plain FSDP engine config carrying strategy odc gets ODC's defaults: lb_mini with the flops cost
    loaded = []
    model = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    s = lb_mini_settings(engine_config("odc"), **kw, model_config=lambda: loaded.append(1) or model)
    assert s.cost.name == "flops" and loaded == [1] and (s.max_token_len, s.micro_batch_size) == (64, None)
    s = lb_mini_settings(
        engine_config("odc", odc_cost_model="fit", odc_cost_fit_a=2.0, odc_cost_fit_b=3.0),
        **{**kw, "use_dynamic_bsz": False, "micro_batch_size": 4},
    )
    assert s.cost(10) == 2.0 * 100 + 3.0 * 10 and (s.max_token_len, s.micro_batch_size) == (None, 4)


# ---------------------------------------------------------------------------------------------
# splitting a batch's metadata
# ---------------------------------------------------------------------------------------------


@needs_tq
def test_split_by_plan_gives_each_rank_its_samples_once_and_its_steps():
    lens = [60, 8, 8, 8, 30, 30, 30, 4]
    # two epochs, reshuffled: a sample may run on another rank in the second epoch
    batch = kv_batch(lens, temperature=1.0, mini_batch_size=4, epochs=2, dataloader_kwargs={"shuffle": True})
    request = PlanRequest(lb_mini_settings(engine_config("odc", odc_cost_model="tokens"), **DYNAMIC), update=True)
    batch.extra_info[PLAN_KEY] = request
    pieces = split_by_plan(batch, 2)
    plan = request.plan
    assert request.seqlens == lens and request.fit is None and request.plan_s > 0
    check_plan(plan, verl_steps(batch, 2, update=True))
    for r, piece in enumerate(pieces):
        assert [t["i"] for t in piece.tags] == plan.rank_positions(r)
        assert piece.keys == [batch.keys[p] for p in plan.rank_positions(r)]
        assert piece.extra_info == {
            "temperature": 1.0,
            "mini_batch_size": 4,
            "epochs": 2,
            "dataloader_kwargs": {"shuffle": True},
            STEPS_KEY: plan.rank_steps(r),
        }
        assert piece.partition_id == "train" and piece.fields == ["input_ids"]
    assert batch.extra_info[PLAN_KEY] is request  # the caller's batch is left alone


@needs_tq
def test_a_forward_only_pass_splits_on_every_member_and_collects_each_sample_once():
    """A forward-only pass planned with the role's UlyssesModel: the split sample goes to every member of its
    group, first, with its group as the pass's one step; the members' outputs (metas of the keys they
    computed) collect to each sample once, as verl's collect requires."""
    import dataclasses

    from transfer_queue import KVBatchMeta

    from odc_plugin.balance.split import UlyssesModel
    from odc_plugin.verl.dispatch import SPLIT_STEPS_KEY, collect_once

    lens = [60, 4, 4, 4, 4, 4, 4, 4]
    training = lb_mini_settings(engine_config("odc", odc_cost_model="tokens"), **DYNAMIC)
    ulysses = UlyssesModel(max_group=2)
    settings = dataclasses.replace(training, ulysses=ulysses).for_inference(64, None, ulysses)
    assert settings.fit_from is not None and settings.ulysses is ulysses
    batch = kv_batch(lens)
    request = PlanRequest(settings, update=False)
    batch.extra_info[PLAN_KEY] = request
    pieces = split_by_plan(batch, 2)
    (split,) = request.plan.splits[0]
    assert split.sample == 0 and list(split.group) == [0, 1]
    for piece in pieces:
        assert piece.keys[0] == batch.keys[0] and piece.extra_info[SPLIT_STEPS_KEY] == [[[0, 1]]]
    outputs = [dataclasses.replace(piece, extra_info={}) for piece in pieces]  # a worker's output: its keys
    collected = KVBatchMeta.concat(collect_once(outputs))
    assert sorted(collected.keys) == sorted(batch.keys)
    assert collect_once([{"metrics": 1}, {"metrics": 2}]) == [{"metrics": 1}, {"metrics": 2}]  # not metas: as is
