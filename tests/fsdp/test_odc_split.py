"""A long sample split over a block of ranks (odc_plugin/fsdp/ulysses.py) inside an ODC mini-batch: the
split samples run first, each over its block (2 or 4 of 4 ranks), then every rank its own micro-batches,
in uneven counts, and the mini-batch ends at ODC's one barrier. Every parameter after AdamW steps equals
one process's on the whole batch and that of the same samples unsplit under ODC (tests/weights.py)."""

from __future__ import annotations

import torch

from odc_plugin.launch import run_ranks

from ..weights import assert_weights_agree
from . import workers
from .test_odc_core import reference_train_steps

STEPS = 3
# sample 0 over all 4 ranks, 1 (odd length: the last slice padded) over ranks 0-1, 2 over ranks 2-3
SPLITS = [(0, (0, 1, 2, 3)), (1, (0, 1)), (2, (2, 3))]


def _sequences() -> list[torch.Tensor]:
    seqs = workers.make_sequences(10, seed=7)
    long = workers.make_sequences(3, seed=8, min_len=60, max_len=120)
    long[1] = long[1][: len(long[1]) // 2 * 2 - 1]
    return long + seqs[3:]


def test_split_samples_train_as_one_process_and_as_unsplit_odc():
    seqs = _sequences()
    own = [[[3, 4], [5]], [[6]], [], [[7], [8], [9]]]  # rank 2 runs only its split
    split = run_ranks(workers.split_train_steps, 4, seqs, SPLITS, own, STEPS)
    whole = [[[0], *own[0]], [[1], *own[1]], [[2]], own[3]]
    unsplit = run_ranks(workers.split_train_steps, 4, seqs, [], whole, STEPS)
    expected = reference_train_steps(seqs, STEPS, arch="qwen2_small")
    # fp32 rtol 1e-5 but for a few weights whose first Adam steps amplify rounding, as for unsplit ODC
    # (on 2026-11-27: split 11, unsplit 12 of 855,296 weights beyond it, both at most 3.7e-6 off)
    print("split vs one process:", assert_weights_agree(split[0], expected, 1e-5, "split"))
    print("unsplit vs one process:", assert_weights_agree(unsplit[0], expected, 1e-5, "unsplit"))
    assert_weights_agree(split[0], unsplit[0], 1e-5, "split vs unsplit")
    assert all(torch.equal(split[r][n], split[0][n]) for r in range(1, 4) for n in expected)


def test_a_split_that_cannot_run_is_refused_on_its_rank():
    for rank, messages in enumerate(run_ranks(workers.split_refusals, 4)):
        assert messages == [
            "a sequence-parallel group must be a power of two that divides the world size 4, got max_group=3",
            "ranks [0, 2] are not a block of these groups (blocks: [(0, 1), (2, 3), (0, 1, 2, 3)])",
            f"rank {rank} runs a micro-batch split over {[2, 3] if rank < 2 else [0, 1]}, which it is not in",
            "5 attention heads do not divide over a sequence-parallel group of 2",
        ], rank
