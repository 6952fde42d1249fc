"""The Triton kernels compiled for the GPU (the interpreter tests check the same arithmetic on CPU)."""

import importlib.util

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
