"""Triton kernels of the GPU transports. Imported lazily: Triton is an optional dependency (`gpu` extra).

Every launcher enqueues on the current CUDA stream and returns at once, so the transports stay stream
ordered inside FSDP's all-gather / reduce-scatter streams. With TRITON_INTERPRET=1 the same kernels run
on CPU tensors (that is how the unit tests check their arithmetic; atomicity and memory ordering can
only be checked on a GPU).

An accumulate into a peer's shard can be built two ways, and the element-wise kernel below serves both
(docs/gpu.md says which measurement chooses):
- remote atomics (`accumulate`): every sender adds straight into the owner's fp32 accumulator with
  atomic adds; the owner does nothing. What the cuda_ipc transport does.
- per-source slots folded by the owner: each sender writes its contribution, in its own dtype, into its
  own slot in the owner's memory with plain stores (`store`), and the owner adds its slots into the
  accumulator locally (`add`): no atomics, but an owner that must take part. The paper authors' design,
  and what the nvshmem transport does (NVSHMEM has no remote float atomics; its fold, `fold_slot`, reads
  a header that says where to add).
Launches follow tiling.plan_tiles: a bounded grid, a grid-stride loop and a start per sender. A thread
handles contiguous elements of a tile and full tiles take no mask, so when both pointers are 16-byte
aligned (Triton specializes every launch on that) the accesses are 128 bits wide, atomics included on
Hopper (tests/comm/test_kernels_ptx.py compiles them for sm_90 and reads the PTX).
"""

from __future__ import annotations

import torch

from .tiling import PROGRAMS, TILE, plan_tiles

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the ODC GPU transports need Triton; install the plugin's `gpu` extra (pip install 'odc-verl[gpu]')"
    ) from e

ATOMIC_ADD, ADD, STORE = 0, 1, 2  # what `_tiles_kernel` does with each element of src
WARPS = 8  # 256 threads: 16 contiguous elements each in a tile of 4096


@triton.jit
def _tile(dst_ptrs, src_ptrs, mask, OP: tl.constexpr, SCOPE: tl.constexpr):
    x = tl.load(src_ptrs, mask=mask)
    if OP == 0:
        # Relaxed: each element only needs to be added exactly once; ordering against the barrier flag is
        # established afterwards (kernel completion + host synchronize, then a release store of the flag).
        # Scope "sys" when dst may be another GPU's memory: a device-scope atomic is only atomic against
        # threads of the issuing GPU, while other GPUs add into the same words at the same time.
        tl.atomic_add(dst_ptrs, x.to(tl.float32), mask=mask, sem="relaxed", scope=SCOPE)
    elif OP == 1:
        tl.store(dst_ptrs, tl.load(dst_ptrs, mask=mask) + x.to(tl.float32), mask=mask)
    else:
        tl.store(dst_ptrs, x, mask=mask)  # converted to dst's dtype by the store


@triton.jit(do_not_specialize=["tiles", "first"])
def _tiles_kernel(dst_ptr, src_ptr, n, tiles, first, TILE: tl.constexpr, OP: tl.constexpr, SCOPE: tl.constexpr):
    # Program p handles tiles first + p, first + p + P, ... (P programs, wrapping around at `tiles`):
    # at any moment the grid works on one window of P tiles, which starts elsewhere for every sender.
    # A while loop: Triton's interpreter takes no `range` bound that is a runtime value.
    programs = tl.num_programs(0)
    lanes = tl.arange(0, TILE)
    i = tl.program_id(0)
    while i < tiles:
        start = tl.multiple_of(((i + first) % tiles).to(tl.int64) * TILE, TILE)
        offs = start + lanes
        # Full tiles without a mask: a mask by `n` would keep Triton from vector accesses unless n is
        # a multiple of 16; only the last, ragged tile pays for it.
        if start + TILE <= n:
            _tile(dst_ptr + offs, src_ptr + offs, None, OP, SCOPE)
        else:
            _tile(dst_ptr + offs, src_ptr + offs, offs < n, OP, SCOPE)
        i += programs


@triton.jit
def _store_release_kernel(flag_ptr, value):
    # Release at system scope: every write this GPU made before (earlier kernels on this stream are
    # complete, and the caller synchronized the device before) is visible to any observer of the flag.
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def _fold_kernel(hdr_ptr, pay_f32_ptr, pay_bf16_ptr, table_ptr, nprog, ROUNDS: tl.constexpr, TILE: tl.constexpr):
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
        offs = (r * nprog + pid) * TILE + tl.arange(0, TILE)
        mask = offs < n
        if code == 1:
            x = tl.load(pay_bf16_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(pay_f32_ptr + offs, mask=mask, other=0.0)
        # Atomic although the accumulator is local: this rank's own accumulates run on another stream
        # (FSDP's reduce-scatter stream) at the same time as folds on the progress stream.
        tl.atomic_add(acc_ptr + base + offs, x, mask=mask, sem="relaxed", scope="gpu")


def _launch(op: int, dst: torch.Tensor, src: torch.Tensor, scope: str, sender: int, senders: int, programs: int):
    """Launch `_tiles_kernel` over dst[:] and src (flattened); returns Triton's compiled kernel (None when
    interpreted or when there is nothing to do)."""
    if op != STORE and dst.dtype != torch.float32:
        raise TypeError(f"ODC accumulators are float32, got {dst.dtype}")
    if not dst.is_contiguous():
        raise ValueError("the destination must be contiguous")
    src = src.reshape(-1)
    if not src.is_contiguous():
        src = src.contiguous()
    n = src.numel()
    if n != dst.numel():
        raise ValueError(f"{n} source elements for {dst.numel()} destination elements")
    plan = plan_tiles(n, sender, senders, programs)
    if not n:
        return None
    return _tiles_kernel[(plan.programs,)](
        dst, src, n, plan.tiles, plan.first, TILE=TILE, OP=op, SCOPE=scope, num_warps=WARPS
    )


def accumulate(
    dst: torch.Tensor,
    src: torch.Tensor,
    scope: str = "sys",
    *,
    sender: int = 0,
    senders: int = 1,
    programs: int = PROGRAMS,
) -> None:
    """dst[:] += src (converted to fp32) with atomic adds, safe against other writers; `dst` is a
    contiguous fp32 tensor. `sender` of `senders` picks the tile this launch starts at."""
    _launch(ATOMIC_ADD, dst, src, scope, sender, senders, programs)


def store(dst: torch.Tensor, src: torch.Tensor, *, sender: int = 0, senders: int = 1, programs: int = PROGRAMS) -> None:
    """dst[:] = src (converted to dst's dtype) with plain stores: a sender filling its own slot."""
    _launch(STORE, dst, src, "gpu", sender, senders, programs)


def add(dst: torch.Tensor, src: torch.Tensor, *, programs: int = PROGRAMS) -> None:
    """dst[:] += src (converted to fp32) without atomics: only for a `dst` no one else writes meanwhile
    (an owner folding a slot into its accumulator)."""
    _launch(ADD, dst, src, "gpu", 0, 1, programs)


def store_release(flag: torch.Tensor, value: int) -> None:
    """flag[0] = value, ordered after every earlier write of this GPU, visible across GPUs."""
    if flag.dtype != torch.int64:
        raise TypeError(f"flags are int64, got {flag.dtype}")
    _store_release_kernel[(1,)](flag, int(value))


def fold_slot(
    slot: torch.Tensor, acc_table: torch.Tensor, max_numel: int, header_bytes: int, max_programs: int = PROGRAMS
) -> None:
    """Add a staging slot's payload into the accumulator its header names (all read on the device).

    `slot` is uint8 (header, then payload); `acc_table` holds the accumulators' addresses (int64);
    `max_numel` bounds the payload (elements) and sizes the work; at most `max_programs` programs share
    it, each striding over the payload.
    """
    hdr = slot[:header_bytes].view(torch.int64)
    payload = slot[header_bytes:]
    plan = plan_tiles(max(max_numel, 1), max_programs=max_programs)
    _fold_kernel[(plan.programs,)](
        hdr,
        payload.view(torch.float32),
        payload.view(torch.bfloat16),
        acc_table,
        plan.programs,
        ROUNDS=plan.rounds,
        TILE=TILE,
        num_warps=WARPS,
    )
