"""The Triton kernels compiled for the GPU (the interpreter tests check the same arithmetic on CPU)."""

import importlib.util
import re

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the `gpu` extra)"),
]


def test_kernels_on_gpu():
    from odc_plugin.comm import kernels

    from .test_kernels_interp import check_kernels

    check_kernels(kernels, torch.device("cuda"))


def test_aligned_accumulates_load_128_bits_at_a_time():
    from odc_plugin.comm import kernels

    acc = torch.zeros(1 << 20, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.ones(1 << 20, device="cuda", dtype=dtype)
        compiled = kernels._launch(kernels.ATOMIC_ADD, acc, src, "sys", 0, 1, kernels.PROGRAMS)
        assert re.search(r"ld\.global\S*\.v4\.", compiled.asm["ptx"]), dtype
    assert acc.eq(2).all()
