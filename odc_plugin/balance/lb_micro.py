"""LB-Micro: verl 0.9.1's own balancing of one mini-batch, run on plain lengths, as the baseline.

verl first splits the mini-batch into equal-size rank partitions balanced by its attention-aware
workload (RayPPOTrainer._balance_batch with keep_minibatch; without it verl balances the whole training
batch, and each mini-batch only on average), then each rank splits its share into micro-batches under
the token budget with rearrange_micro_batches, which all-reduces the micro-batch count so that every
rank runs the same number of micro-batches in lockstep. Both steps call verl's functions; only the
all-reduce is replayed here, since there is no process group. (_balance_batch also reorders each share,
which only changes how rearrange_micro_batches breaks ties between equal workloads.)
"""

from __future__ import annotations

from collections.abc import Sequence

from odc_plugin.balance.common import RankPlan, check_minibatch

# verl, torch and tensordict are imported where used: they take seconds to import, and the rest of the
# package (LB-Mini, the cost models, the lengths) is pure Python.


def verl_rank_partition(seqlens: Sequence[int], dp_size: int) -> list[list[int]]:
    """verl's equal-size, workload-balanced split of a mini-batch over ranks (sample indices per rank)."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    if len(seqlens) < dp_size or len(seqlens) % dp_size:
        raise ValueError(
            f"verl splits a mini-batch into equal rank shares: {len(seqlens)} samples do not divide over "
            f"{dp_size} ranks"
        )
    workloads = calculate_workload(torch.tensor(seqlens, dtype=torch.long)).tolist()
    return get_seqlen_balanced_partitions(workloads, k_partitions=dp_size, equal_size=True)


def lb_micro(seqlens: Sequence[int], dp_size: int, max_token_len: int) -> RankPlan:
    """Per rank, micro-batches of sample indices in verl's execution order; the same count on every rank."""
    lens = check_minibatch(seqlens, dp_size, max_token_len)
    ranks = verl_rank_partition(lens, dp_size)
    batches = [_as_verl_batch([lens[i] for i in rank]) for rank in ranks]
    # At least one micro-batch: verl derives the count from the token total, which is 0 for a rank of empty samples.
    local = [_split(b, max_token_len, 1) for b in batches]
    # rearrange_micro_batches with a dp group starts every rank at the largest rank's count and raises it
    # until every rank fits. Re-running the ranks that settled below the current maximum, starting there,
    # reaches the same count: no rank can settle above the first count at which all ranks fit.
    while True:
        shared = max(len(m) for m in local)
        if all(len(m) == shared for m in local):
            break
        local = [m if len(m) == shared else _split(b, max_token_len, shared) for m, b in zip(local, batches)]
    return [[[rank[i] for i in mb] for mb in m] for rank, m in zip(ranks, local)]


def _as_verl_batch(lens: list[int]):
    """The remove-padding layout verl's engine hands to rearrange_micro_batches: jagged input_ids.

    The token values are never read, so one zero is broadcast over all of them instead of allocated.
    """
    import torch
    from tensordict import TensorDict

    offsets = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)
    values = torch.zeros(1, dtype=torch.uint8).expand(int(offsets[-1]))
    input_ids = torch.nested.nested_tensor_from_jagged(values, offsets)
    return TensorDict({"input_ids": input_ids}, batch_size=[len(lens)])


def _split(batch, max_token_len: int, min_num_micro_batch: int) -> list[list[int]]:
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    _, idx = rearrange_micro_batches(batch, max_token_len=max_token_len, min_num_micro_batch=min_num_micro_batch)
    return idx
