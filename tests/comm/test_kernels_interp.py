"""The transports' Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

This checks the kernels' arithmetic, masking, dtype handling, the slot header layout shared with the
NVSHMEM transport's packing, and the region table; atomicity under concurrent writers and memory
ordering need a GPU (tests/comm/test_gpu_*.py). Skipped when Triton is not installed.
"""

import importlib.util
import pathlib

import pytest
import torch

from odc_plugin.comm.nvshmem import HEADER_BYTES, pack_slot

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "odc_plugin" / "comm" / "kernels.py"


def check_kernels(kernels, device):
    # accumulate: bf16 / fp16 / fp32 sources, converted while adding, into an offset slice; sizes that
    # are not a multiple of the block; a non-contiguous source.
    n = 3 * kernels.BLOCK + 7
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
    with pytest.raises(ValueError, match="accumulate of 3 elements into 2"):
        kernels.accumulate(acc[:2], vals[:3])

    # store_release writes exactly one int64 flag.
    flags = torch.zeros(4, dtype=torch.int64, device=device)
    kernels.store_release(flags[2:3], 123456789012)
    assert flags.tolist() == [0, 0, 123456789012, 0]

    # fold_slot: slots packed exactly as the NVSHMEM transport packs them, two accumulators named by
    # region id, fp32 and bf16 payloads, a payload larger than the grid covers in one pass.
    acc_a = torch.zeros(5000, device=device)
    acc_b = torch.zeros(300, device=device)
    table = torch.tensor([acc_a.data_ptr(), acc_b.data_ptr()], dtype=torch.int64, device=device)
    slot = torch.zeros(HEADER_BYTES + 4 * 3000, dtype=torch.uint8, device=device)
    src = torch.arange(3000, dtype=torch.float32, device=device) % 61
    assert pack_slot(slot, 1000, src, 0) == HEADER_BYTES + 4 * 3000
    kernels.fold_slot(slot, table, 3000, HEADER_BYTES, max_programs=1)  # one program strides over it all
    assert pack_slot(slot, 17, src[:200].to(torch.bfloat16), 1) == HEADER_BYTES + 2 * 200
    kernels.fold_slot(slot, table, 3000, HEADER_BYTES)
    want_a = torch.zeros(5000, device=device)
    want_a[1000:4000] = src
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
    spec = importlib.util.spec_from_file_location("odc_kernels_interpreted", KERNELS)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    check_kernels(kernels, torch.device("cpu"))
