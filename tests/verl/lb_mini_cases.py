"""Batches and configs shared by the LB-Mini tests: TransferQueue metadata of given lengths, verl's own steps
in order, a plan's invariants, an engine config per strategy."""

from __future__ import annotations

from odc_plugin.verl.dispatch import StepPlan


def kv_batch(lens, **extra):
    from transfer_queue import KVBatchMeta

    keys = [f"uid{i}_0_0" for i in range(len(lens))]
    return KVBatchMeta(
        keys=keys,
        tags=[{"seq_len": s, "i": i} for i, s in enumerate(lens)],
        partition_id="train",
        fields=["input_ids"],
        extra_info=dict(extra),
    )


def in_order(n: int, dp: int, per_rank: int) -> list[list[list[int]]]:
    """verl's steps without shuffling, one epoch: rank r's chunk cut in order into pieces of `per_rank`."""
    chunk = n // dp
    return [
        [list(range(r * chunk + s * per_rank, r * chunk + (s + 1) * per_rank)) for r in range(dp)]
        for s in range(chunk // per_rank)
    ]


def check_plan(plan: StepPlan, stock) -> None:
    assert plan.num_steps == len(stock) and plan.dp_size == len(stock[0])
    for step, stock_step in zip(plan.steps, stock):
        # every step trains on exactly verl's samples of that step, each once, a sample or more on every rank
        assert sorted(p for share in step for p in share) == sorted(p for piece in stock_step for p in piece)
        assert all(share for share in step)
    for r in range(plan.dp_size):
        positions = plan.rank_positions(r)
        assert len(positions) == len(set(positions))
        assert [[positions[i] for i in idx] for idx in plan.rank_steps(r)] == [list(s[r]) for s in plan.steps]


def engine_config(strategy, **odc):
    from verl.workers.config import FSDPEngineConfig

    from odc_plugin.verl.config import ODCEngineConfig

    if odc:
        return ODCEngineConfig(**odc)
    cfg = FSDPEngineConfig(strategy="fsdp2")
    object.__setattr__(cfg, "strategy", strategy)  # as FSDPActorConfig.__post_init__ does
    return cfg


DYNAMIC = {"use_dynamic_bsz": True, "max_token_len": 64, "micro_batch_size": None}
