"""The transports' Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

This checks the kernels' arithmetic, masking, dtype handling, the bounded grid and per-sender starts
of their launches, the slot header layout shared with the NVSHMEM transport's packing, and the region
table; atomicity under concurrent writers and memory ordering need a GPU (tests/comm/test_gpu_*.py).
Skipped when Triton is not installed.
"""

import contextlib
import importlib.util
import pathlib

import pytest
import torch

from odc_plugin.comm.nvshmem_staging import HEADER_BYTES, pack_slot
from odc_plugin.comm.slots import Slots
from odc_plugin.comm.tiling import PROGRAMS, TILE

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "odc_plugin" / "comm" / "kernels.py"
# Sizes around the tile: one element, under one tile, one over, several tiles and a ragged end.
ODD_SIZES = (1, 7, TILE - 1, TILE + 1, 5 * TILE + 3)


@contextlib.contextmanager
def recorded_launches(kernels):
    """Record (grid, n, tiles, first) of every launch of the element-wise kernel while inside."""
    kernel, launches = kernels._tiles_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, *args[2:5]))
                return kernel[grid](*args, **kwargs)

            return launch

    kernels._tiles_kernel = Recorder()
    try:
        yield launches
    finally:
        kernels._tiles_kernel = kernel


def check_kernels(kernels, device):
    # accumulate: bf16 / fp16 / fp32 sources, converted while adding, into an offset slice; sizes that
    # are not a multiple of the tile; a non-contiguous source.
    n = 3 * TILE + 7
    acc = torch.zeros(n + 11, device=device)
    vals = torch.arange(n, dtype=torch.float32, device=device) % 97 - 48
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kernels.accumulate(acc[5 : 5 + n], vals.to(dtype), scope="sys")
    kernels.accumulate(acc[5 : 5 + n], torch.stack([vals, vals]).t()[:, 0], scope="gpu")
    want = torch.zeros(n + 11, device=device)
    want[5 : 5 + n] = 4 * vals
    assert torch.equal(acc, want)
    kernels.accumulate(acc[:0], vals[:0])  # nothing to do
    with pytest.raises(TypeError, match="float32"):
        kernels.accumulate(acc.to(torch.bfloat16), vals)
    with pytest.raises(TypeError, match="float32"):
        kernels.add(acc.to(torch.bfloat16), vals)
    with pytest.raises(ValueError, match="3 source elements for 2 destination elements"):
        kernels.accumulate(acc[:2], vals[:3])
    with pytest.raises(ValueError, match="contiguous"):
        kernels.store(acc[::2][:2], vals[:2])

    # Several senders into one owner, each from its own start, with grids from one program to more
    # than there are tiles: every element is added exactly once by each sender (integers: exact sums).
    for numel in ODD_SIZES:
        grad = torch.arange(numel, dtype=torch.float32, device=device) % 13 + 1
        for programs in (1, 2, PROGRAMS):
            acc = torch.zeros(numel + 2, device=device)
            for sender in range(3):
                kernels.accumulate(acc[1:-1], grad * (sender + 1), sender=sender, senders=3, programs=programs)
            assert acc[0] == 0 and acc[-1] == 0 and torch.equal(acc[1:-1], 6 * grad), (numel, programs)

    # Per-source slots folded by the owner give the atomics' sum: each of 3 senders stores its bf16
    # gradient into its own slot of the owner's inbox, from its own start; the owner adds its slots.
    numel = ODD_SIZES[-1]
    grads = [(torch.arange(numel, device=device) % (11 + s)).to(torch.bfloat16) for s in range(3)]
    inbox = torch.full((3, numel + 1), -1.0, dtype=torch.bfloat16, device=device)
    for sender, grad in enumerate(grads):
        kernels.store(inbox[sender, :numel], grad, sender=sender, senders=3, programs=2)
    assert inbox[:, numel].eq(-1).all() and all(torch.equal(inbox[s, :numel], grads[s]) for s in range(3))
    acc = torch.zeros(numel, device=device)
    for sender in range(3):
        kernels.add(acc, inbox[sender, :numel])
    assert torch.equal(acc, sum(g.float() for g in grads))
    fp32_slot = torch.zeros(numel, device=device)
    kernels.store(fp32_slot, grads[1])  # converted on the way in
    assert torch.equal(fp32_slot, grads[1].float())

    # cuda_ipc's "slots" method: 3 senders add, several times each, fp32 and bf16, without atomics into their
    # own slots of an owner's allocation (the slot found as the transport finds it), the owner adds its own
    # straight into the accumulator, and its fold gives what atomic adds into the accumulator give.
    numel, owner = ODD_SIZES[-1], 1
    full = torch.zeros(Slots.allocated_numel(numel, 3), device=device)
    slots, direct = Slots(numel, 3, full), torch.zeros(numel, device=device)
    for sender, grad in enumerate(grads):
        for dtype in (torch.float32, torch.bfloat16):
            into = full[:numel] if sender == owner else slots.slot_in(full, sender, owner)
            kernels.add(into[5:], grad[5:].to(dtype))
            kernels.accumulate(direct[5:], grad[5:].to(dtype), sender=sender, senders=3)
    slots.fold()
    assert torch.equal(full[:numel], direct) and full[numel:].eq(0).all()

    # The grid is bounded whatever the size, and each sender's launch starts at its own tile.
    with recorded_launches(kernels) as launches:
        big = torch.ones(100 * TILE, device=device)
        acc = torch.zeros_like(big)
        for sender in range(4):
            kernels.accumulate(acc, big, sender=sender, senders=4)
        kernels.add(acc, big, programs=3)
    assert torch.equal(acc, torch.full_like(big, 5.0))
    assert launches == [((PROGRAMS,), 100 * TILE, 100, first) for first in (0, 25, 50, 75)] + [
        ((3,), 100 * TILE, 100, 0)
    ]

    # store_release writes exactly one int64 flag.
    flags = torch.zeros(4, dtype=torch.int64, device=device)
    kernels.store_release(flags[2:3], 123456789012)
    assert flags.tolist() == [0, 0, 123456789012, 0]

    # fold_slot: slots packed exactly as the NVSHMEM transport packs them, two accumulators named by
    # region id, fp32 and bf16 payloads, a payload larger than the grid covers in one pass.
    m = 2 * TILE + 5
    acc_a = torch.zeros(m + 2000, device=device)
    acc_b = torch.zeros(300, device=device)
    table = torch.tensor([acc_a.data_ptr(), acc_b.data_ptr()], dtype=torch.int64, device=device)
    slot = torch.zeros(HEADER_BYTES + 4 * m, dtype=torch.uint8, device=device)
    src = torch.arange(m, dtype=torch.float32, device=device) % 61
    assert pack_slot(slot, 1000, src, 0) == HEADER_BYTES + 4 * m
    kernels.fold_slot(slot, table, m, HEADER_BYTES, max_programs=1)  # one program strides over it all
    assert pack_slot(slot, 17, src[:200].to(torch.bfloat16), 1) == HEADER_BYTES + 2 * 200
    kernels.fold_slot(slot, table, m, HEADER_BYTES)
    want_a = torch.zeros(m + 2000, device=device)
    want_a[1000 : 1000 + m] = src
    want_b = torch.zeros(300, device=device)
    want_b[17:217] = src[:200]
    assert torch.equal(acc_a, want_a) and torch.equal(acc_b, want_b)
    with pytest.raises(ValueError, match="do not fit a slot"):
        pack_slot(slot, 0, src.repeat(2), 0)


def test_kernels_in_the_triton_interpreter(monkeypatch):
    pytest.importorskip(
        "triton", reason="Triton is not installed (the `gpu` extra); interpreter test skipped", exc_type=ImportError
    )
    # The interpreter is chosen when a kernel is decorated: load a private copy of the module with it on,
    # so that a process that also runs the GPU tests keeps its compiled kernels.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("odc_plugin.comm.kernels_interpreted", KERNELS)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    check_kernels(kernels, torch.device("cpu"))
