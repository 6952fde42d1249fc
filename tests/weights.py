"""Comparing trained weights that were summed in different orders.

Float32 sums taken in another order (ODC's arrival order, gloo's, another attention layout) differ in
the last bit. Adam divides by the gradient's running magnitude, so on a weight whose gradient is near
zero that bit can move the update noticeably, and with bf16 gathers a master weight on a rounding edge
can round the other way. Such weights are rare: they are counted and bounded, every other weight must
match to rtol 1e-5.
"""

from __future__ import annotations

import torch

RTOL, ATOL = 1e-5, 1e-6


def assert_weights_agree(got: dict, want: dict, bound: float, label: str = "") -> str:
    """Every tensor of `got` within `bound` of `want`'s, and at most 0.1% of all elements beyond
    rtol 1e-5 (atol 1e-6); returns a one-line summary for the test's output."""
    assert got.keys() == want.keys(), (label, sorted(set(got) ^ set(want)))
    off = total = 0
    worst = 0.0
    for name, value in want.items():
        diff = (got[name] - value).abs()
        off += int((diff > ATOL + RTOL * value.abs()).sum())
        total += value.numel()
        worst = max(worst, float(diff.max()))
        assert diff.max() < bound, f"{label} {name}: {float(diff.max()):.3g} apart (bound {bound:g})"
    assert off <= total // 1000, f"{label}: {off} of {total} weights differ beyond rtol {RTOL:g}"
    return f"max {worst:.3g}, {off} of {total} beyond rtol {RTOL:g}"


def over_ranks(per_rank: list[dict]) -> dict:
    """Every rank's weights in one dict keyed by (rank, name), to compare all ranks at once."""
    return {(rank, name): value for rank, weights in enumerate(per_rank) for name, value in weights.items()}


def assert_trained(after: dict, before: dict) -> None:
    for name, value in after.items():
        assert not torch.equal(value, before[name]), f"{name} did not train"
