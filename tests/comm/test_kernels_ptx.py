"""The element-wise kernel compiled ahead of time for an H100 (sm_90) on a machine without a GPU: Triton's
own compiler and the ptxas it ships, so the PTX read here is what a GPU would run. It shows the memory
accesses of the launches the transports make: 128 bits wide, atomics included, on every full tile when
both pointers are 16-byte aligned (Triton specializes each launch on that), whatever the element count;
one element at a time when they are not. Skipped without Triton."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed (the `gpu` extra)", exc_type=ImportError)


def compile_ptx(op: int, dst: str, src: str, aligned: bool) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from odc_plugin.comm import kernels

    signature = {"dst_ptr": f"*{dst}", "src_ptr": f"*{src}", "n": "i32", "tiles": "i32", "first": "i32"}
    signature |= {"TILE": "constexpr", "OP": "constexpr", "SCOPE": "constexpr"}
    # A launch with 16-byte aligned pointers and an element count that is no multiple of 16.
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]} if aligned else {}
    source = ASTSource(
        fn=kernels._tiles_kernel,
        signature=signature,
        constexprs={"TILE": kernels.TILE, "OP": op, "SCOPE": "sys"},
        attrs=attrs,
    )
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernels.WARPS})
    except RuntimeError as e:  # a Triton build without the CUDA backend or its ptxas
        pytest.skip(f"Triton cannot compile for sm_90 here: {e}")
    return compiled.asm["ptx"]


def accesses(ptx: str, pattern: str) -> set[str]:
    return set(re.findall(pattern, ptx))


@pytest.mark.parametrize("src", ["fp32", "bf16"])
def test_aligned_accumulates_load_and_add_128_bits_at_a_time(src):
    from odc_plugin.comm import kernels

    ptx = compile_ptx(kernels.ATOMIC_ADD, "fp32", src, aligned=True)
    assert "ld.global.v4.b32" in accesses(ptx, r"ld\.global\S*")
    # full tiles: vector atomics at system scope; the ragged last tile: one element at a time
    assert accesses(ptx, r"atom\.global\S*") == {
        "atom.global.sys.relaxed.add.v4.f32",
        "atom.global.sys.relaxed.add.f32",
    }


def test_slot_stores_and_folds_are_128_bits_wide_too():
    from odc_plugin.comm import kernels

    assert "st.global.v4.b32" in accesses(compile_ptx(kernels.STORE, "bf16", "bf16", aligned=True), r"st\.global\S*")
    fold = compile_ptx(kernels.ADD, "fp32", "bf16", aligned=True)
    assert "st.global.v4.b32" in accesses(fold, r"st\.global\S*") and not accesses(fold, r"atom\.global\S*")


def test_unaligned_pointers_get_no_vector_accesses():
    from odc_plugin.comm import kernels

    ptx = compile_ptx(kernels.ATOMIC_ADD, "fp32", "fp32", aligned=False)
    assert accesses(ptx, r"ld\.global\S*") == {"ld.global.b32"}
    assert accesses(ptx, r"atom\.global\S*") == {"atom.global.sys.relaxed.add.f32"}
