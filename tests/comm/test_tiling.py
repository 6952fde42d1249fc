"""How the GPU kernels' launches are cut (pure; runs without Triton): a bounded grid for any size, and
senders that start at evenly spread tiles of the same range. The kernels' walk from those starts is
checked in Triton's interpreter (test_kernels_interp.py)."""

import pytest

from odc_plugin.comm.tiling import PROGRAMS, TILE, TilePlan, plan_tiles


def test_the_grid_is_bounded_however_large_the_shard():
    # A 7B model's decoder layer (~233M parameters) sharded over 8 ranks: the old kernel launched one
    # program per 1024 elements, ~28K programs; now PROGRAMS, each looping.
    shard = 233_000_000 // 8
    plan = plan_tiles(shard)
    assert plan.programs == PROGRAMS < 132  # fewer programs than an H100 has SMs
    assert plan.tiles == -(-shard // TILE) and plan.programs * plan.rounds >= plan.tiles
    assert plan_tiles(shard, max_programs=8).programs == 8


@pytest.mark.parametrize(
    "numel,tiles,programs", [(0, 0, 1), (1, 1, 1), (TILE, 1, 1), (TILE + 1, 2, 2), (3 * TILE, 3, 3)]
)
def test_small_transfers_take_one_program_per_tile(numel, tiles, programs):
    plan = plan_tiles(numel)
    assert (plan.tiles, plan.programs, plan.first) == (tiles, programs, 0)


def test_each_sender_starts_at_its_own_share_of_the_range():
    starts = [plan_tiles(64 * TILE, sender, 8).first for sender in range(8)]
    assert starts == [0, 8, 16, 24, 32, 40, 48, 56]
    # fewer tiles than senders: starts repeat only where they must, and stay inside the range
    assert [plan_tiles(3 * TILE, s, 4).first for s in range(4)] == [0, 0, 1, 2]
    assert plan_tiles(5 * TILE + 3, 2, 3) == TilePlan(tiles=6, programs=6, rounds=1, first=4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="sender 3 out of range for 3 sender"):
        plan_tiles(10, 3, 3)
    with pytest.raises(ValueError, match="max_programs must be >= 1"):
        plan_tiles(10, max_programs=0)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        plan_tiles(-1)
