"""Triton kernels of the GPU transports. Imported lazily: Triton is an optional dependency (`gpu` extra).

Every launcher enqueues on the current CUDA stream and returns at once, so the transports stay stream
ordered inside FSDP's all-gather / reduce-scatter streams. With TRITON_INTERPRET=1 the same kernels run
on CPU tensors (that is how the unit tests check their arithmetic; atomicity and memory ordering can
only be checked on a GPU).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the ODC GPU transports need Triton; install the plugin's `gpu` extra (pip install 'odc-verl[gpu]')"
    ) from e

BLOCK = 1024


@triton.jit
def _accumulate_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr, SCOPE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Relaxed: each element only needs to be added exactly once; ordering against the barrier flag is
    # established afterwards (kernel completion + host synchronize, then a release store of the flag).
    # Scope "sys" when dst may be another GPU's memory: a device-scope atomic is only atomic against
    # threads of the issuing GPU, while other GPUs add into the same words at the same time.
    tl.atomic_add(dst_ptr + offs, x, mask=mask, sem="relaxed", scope=SCOPE)


@triton.jit
def _store_release_kernel(flag_ptr, value):
    # Release at system scope: every write this GPU made before (earlier kernels on this stream are
    # complete, and the caller synchronized the device before) is visible to any observer of the flag.
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def _fold_kernel(hdr_ptr, pay_f32_ptr, pay_bf16_ptr, table_ptr, nprog, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    # The owner's host does not know what a slot holds: the header, delivered by the same put as the
    # payload, says where to add (element offset), how much, in which dtype and into which region (an
    # index into the table of accumulator addresses). Layout: odc_plugin/comm/nvshmem.py, HEADER_BYTES.
    # The loop runs over the slot's capacity (ROUNDS, a compile-time constant: one value per slot size),
    # the mask over the header's count: Triton's interpreter takes no loop bound that is a runtime value.
    pid = tl.program_id(0)
    base = tl.load(hdr_ptr)
    n = tl.load(hdr_ptr + 1)
    code = tl.load(hdr_ptr + 2)
    acc_ptr = tl.load(table_ptr + tl.load(hdr_ptr + 3)).to(tl.pointer_type(tl.float32))
    for r in range(ROUNDS):
        offs = (r * nprog + pid) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if code == 1:
            x = tl.load(pay_bf16_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(pay_f32_ptr + offs, mask=mask, other=0.0)
        # Atomic although the accumulator is local: this rank's own accumulates run on another stream
        # (FSDP's reduce-scatter stream) at the same time as folds on the progress stream.
        tl.atomic_add(acc_ptr + base + offs, x, mask=mask, sem="relaxed", scope="gpu")


def accumulate(dst: torch.Tensor, src: torch.Tensor, scope: str = "sys") -> None:
    """dst[:] += src (converted to fp32) with atomic adds; `dst` is a contiguous fp32 tensor."""
    if dst.dtype != torch.float32:
        raise TypeError(f"ODC accumulators are float32, got {dst.dtype}")
    if not dst.is_contiguous():
        raise ValueError("accumulate needs a contiguous destination")
    src = src.reshape(-1)
    if not src.is_contiguous():
        src = src.contiguous()
    n = src.numel()
    if n != dst.numel():
        raise ValueError(f"accumulate of {n} elements into {dst.numel()}")
    if n:
        _accumulate_kernel[(triton.cdiv(n, BLOCK),)](dst, src, n, BLOCK=BLOCK, SCOPE=scope)


def store_release(flag: torch.Tensor, value: int) -> None:
    """flag[0] = value, ordered after every earlier write of this GPU, visible across GPUs."""
    if flag.dtype != torch.int64:
        raise TypeError(f"flags are int64, got {flag.dtype}")
    _store_release_kernel[(1,)](flag, int(value))


def fold_slot(
    slot: torch.Tensor, acc_table: torch.Tensor, max_numel: int, header_bytes: int, max_programs: int = 1024
) -> None:
    """Add a staging slot's payload into the accumulator its header names (all read on the device).

    `slot` is uint8 (header, then payload); `acc_table` holds the accumulators' addresses (int64);
    `max_numel` bounds the payload (elements) and sizes the work; at most `max_programs` programs share
    it, each striding over the payload.
    """
    hdr = slot[:header_bytes].view(torch.int64)
    payload = slot[header_bytes:]
    nprog = max(1, min(triton.cdiv(max_numel, BLOCK), max_programs))
    rounds = triton.cdiv(max(max_numel, 1), nprog * BLOCK)
    _fold_kernel[(nprog,)](
        hdr, payload.view(torch.float32), payload.view(torch.bfloat16), acc_table, nprog, ROUNDS=rounds, BLOCK=BLOCK
    )
