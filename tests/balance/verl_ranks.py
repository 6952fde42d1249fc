"""Rank bodies: verl's rearrange_micro_batches with a real data-parallel group, and verl's FlopsCounter."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict


def rearrange_on_rank(rank: int, world_size: int, cases: list[tuple[list[list[int]], int]]) -> list[list[list[int]]]:
    """For each (lengths per rank, max_token_len), this rank's micro-batches of local sample indices."""
    from verl.utils import seqlen_balancing

    # verl has no CPU platform and falls back to "cuda" for the tensors it all-reduces; gloo wants "cpu".
    seqlen_balancing.get_device_name = lambda: "cpu"
    out = []
    for lens_per_rank, max_token_len in cases:
        lens = torch.tensor(lens_per_rank[rank])
        # verl's classic right-padded layout, unlike the jagged one lb_micro uses.
        mask = (torch.arange(int(lens.max())) < lens[:, None]).long()
        batch = TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(lens)])
        _, idx = seqlen_balancing.rearrange_micro_batches(batch, max_token_len=max_token_len, dp_group=dist.group.WORLD)
        out.append(idx)
    return out


def flops_counter_on_rank(rank: int, world_size: int, config_dirs: list[str], batches: list[list[int]]) -> list:
    """verl's FlopsCounter as its trainer uses it (estimate_flops also asks the device for its peak, which
    needs verl's device platform: this rank runs verl on CPU): per config, the FLOPs of each batch of
    sequence lengths in one second."""
    from transformers import AutoConfig
    from verl.utils.flops_counter import FlopsCounter

    counters = [FlopsCounter(AutoConfig.from_pretrained(d)) for d in config_dirs]
    return [[c.estimate_flops(batch, delta_time=1.0)[0] * 1e12 for batch in batches] for c in counters]
