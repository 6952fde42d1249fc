"""The unbounded accumulate kernel, kept as the benchmarks' baseline.

One program per 1024 elements (about 28K programs for a 7B model's decoder layer sharded over 8 ranks),
every sender starting at element 0 of the owner's range, one fp32 atomic add per element. The
transports now use odc_plugin/comm/kernels.py (bounded grid, per-sender start); this file is imported
only by benchmarks on a GPU machine (it needs Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _accumulate_v0_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr, SCOPE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(dst_ptr + offs, x, mask=mask, sem="relaxed", scope=SCOPE)


def accumulate_v0(dst: torch.Tensor, src: torch.Tensor, scope: str = "sys") -> None:
    """dst[:] += src with the old launch: contiguous fp32 `dst`, `src` of the same size."""
    src = src.reshape(-1).contiguous()
    if dst.dtype != torch.float32 or not dst.is_contiguous() or src.numel() != dst.numel():
        raise ValueError("accumulate_v0 needs a contiguous fp32 destination of the source's size")
    if src.numel():
        _accumulate_v0_kernel[(triton.cdiv(src.numel(), BLOCK),)](dst, src, src.numel(), BLOCK=BLOCK, SCOPE=scope)
