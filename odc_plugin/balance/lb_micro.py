"""LB-Micro: verl 0.9.1's own balancing of one mini-batch, run on plain lengths, as the baseline.

verl first splits the mini-batch into equal-size rank partitions balanced by its attention-aware
workload (RayPPOTrainer._balance_batch with keep_minibatch; without it verl balances the whole training
batch, and each mini-batch only on average), then each rank splits its share into micro-batches under
the token budget with rearrange_micro_batches, which all-reduces the micro-batch count so that every
rank runs the same number of micro-batches in lockstep. Both steps call verl's functions; only the
all-reduce is replayed here, since there is no process group. (_balance_batch also reorders each share,
which only changes how rearrange_micro_batches breaks ties between equal workloads.) With a fixed
micro-batch size (no dynamic batch size) each rank cuts its share in order into pieces of that size.

`verl_micro_batches` is verl's packing of one rank's share as the ODC engine runs it (no agreement on the
count), which LB-Mini's plans use too.
"""

from __future__ import annotations

from collections.abc import Sequence

from odc_plugin.balance.common import RankPlan, check_minibatch, chunk

# verl, torch and tensordict are imported where used: they take seconds to import, so the package imports
# without them; only verl's own splitting loads them (LB-Micro, and LB-Mini's packing under a token budget).


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


def lb_micro(
    seqlens: Sequence[int],
    dp_size: int,
    max_token_len: int,
    micro_batch_size: int | None = None,
    balance_ranks: bool = True,
) -> RankPlan:
    """Per rank, micro-batches of sample indices in verl's execution order; the same count on every rank.

    With `micro_batch_size` (verl's `ppo_micro_batch_size_per_gpu`, no dynamic batch size) every micro-batch
    holds that many samples, whatever their tokens, as verl's prepare_micro_batches cuts a share. Without
    `balance_ranks` each rank takes its contiguous chunk of the mini-batch, as verl's torchrun SFT trainer's
    ranks take their samplers' shares (the lengths come in the sampler's random order)."""
    lens = check_minibatch(seqlens, dp_size, max_token_len)
    each = len(lens) // dp_size
    ranks = verl_rank_partition(lens, dp_size) if balance_ranks else chunk(list(range(len(lens))), each)
    if micro_batch_size is not None:
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1 or each % micro_batch_size:
            raise ValueError(
                f"verl cuts each rank's {each} samples into micro-batches of micro_batch_size samples, which "
                f"must divide them; got micro_batch_size={micro_batch_size!r}"
            )
        return [chunk(rank, micro_batch_size) for rank in ranks]
    return lockstep_micro_batches(lens, ranks, max_token_len)


def lockstep_micro_batches(seqlens: Sequence[int], shares: list[list[int]], max_token_len: int) -> RankPlan:
    """Each rank's share (indices into seqlens) cut into micro-batches under the token budget as verl's
    rearrange_micro_batches cuts it with a dp group: as many on every rank as the busiest needs."""
    batches = [_as_verl_batch([seqlens[i] for i in share]) for share in shares]
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
    return [[[share[i] for i in mb] for mb in m] for share, m in zip(shares, local)]


def verl_micro_batches(seqlens: Sequence[int], max_token_len: int) -> list[list[int]]:
    """One rank's micro-batches (indices into seqlens, each at most max_token_len) as the ODC engine packs
    its share: verl's rearrange_micro_batches under the token budget, without agreeing on their number with
    other ranks (what the engine's prepare_micro_batches call does with same_micro_num_in_dp=False)."""
    lens = list(seqlens)
    return _split(_as_verl_batch(lens), max_token_len, 1) if lens else []


def _as_verl_batch(lens: list[int]):
    """A batch that rearrange_micro_batches reads as sequences of these lengths, in its padded layout: a
    sequence's length is its attention mask's row sum, and the mask is only summed, so each row is one
    column holding the length. The engines' jagged layout gives the same lengths (tests/balance checks the
    packings against it); one column keeps the micro-batches verl cuts from this batch, which are thrown
    away, cheap (the jagged ones cost most of a plan's time)."""
    import torch
    from tensordict import TensorDict

    column = torch.tensor(lens, dtype=torch.long)[:, None]
    return TensorDict({"input_ids": torch.zeros_like(column), "attention_mask": column}, batch_size=[len(lens)])


def _split(batch, max_token_len: int, min_num_micro_batch: int) -> list[list[int]]:
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    _, idx = rearrange_micro_batches(batch, max_token_len=max_token_len, min_num_micro_batch=min_num_micro_batch)
    return idx
