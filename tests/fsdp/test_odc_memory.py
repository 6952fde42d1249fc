"""ODC's memory as the system sees it, in each state, and its release and rebuild between phases.

`memory_bytes()` against what the transport really allocated: on CPU the files of the shared-memory
transport that the rank's process maps (read from /proc/self/maps and the files' sizes), on a GPU torch's
allocated bytes. Released, a model leaves only the transport's control words; rebuilt, it trains on, and a
`.grad` carried across the release is summed in as one process sums it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from odc_plugin.launch import run_ranks

from . import memory_workers, workers
from .memory_workers import CONTROL_REGIONS
from .test_odc_core import random_plan, reference_grads

WORLD = 3
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory_gpu.py"
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and Triton (the `gpu` extra) for the cuda_ipc transport",
)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_memory_bytes_are_what_the_transport_allocated_and_a_release_leaves_only_its_control_words(device):
    seqs = workers.make_sequences(18, seed=35)
    plans = [random_plan(9, [2, 1, 3], seed=35), random_plan(9, [1, 3, 0], seed=36)]
    plans[1] = [[[9 + i for i in mb] for mb in rank] for rank in plans[1]]  # the second half of the samples
    results = run_ranks(memory_workers.lifecycle, WORLD, seqs, plans, device)
    expected = reference_grads(seqs, device)  # both mini-batches' samples: the carried `.grad` plus the second
    for rank, r in enumerate(results):
        built, inside, released = r["built"], r["in_minibatch"], r["released"]
        print(
            f"rank {rank}: built {built.regions} B (published {built.published}, accumulator {built.accumulator}, "
            f"scratch {built.scratch}), in a mini-batch {inside.regions} B ({inside.extra_bytes_per_param:.3f} "
            f"extra bytes/param), released {released.regions} B, control words {released.control} B"
        )
        # during a backward mini-batch the zeros `.grad` points at (the largest shard) join the ones
        assert built.scratch == r["ones"] == r["after_end"].scratch, rank
        assert inside.scratch == r["ones"] + 4 * r["shard_max"], rank
        assert (inside.published, inside.accumulator) == (built.published, built.accumulator), rank
        assert released.regions == 0 and released.grad_storage == 0 and released.control == built.control, rank
        assert r["rebuilt_released"] == released, rank
        assert r["grads_kept"], rank
        message, opened = r["begin_refused"]
        assert message.startswith("ODC's regions are released") and not opened, rank
        message, gone = r["release_refused"]
        assert message.startswith("ODC release() inside a mini-batch") and not gone, rank
        fwd, fwd_released = r["forward_only"], r["forward_only_released"]
        assert fwd.accumulator == 0 and fwd.scratch == 0 and fwd_released.regions == 0, rank
        if device == "cpu":
            files = r["built_files"]
            assert built.published == files["odc.params"] + files["odc.published"], (rank, files)
            assert built.accumulator == files["odc.grads"] and built.control == sum(
                files[name] for name in CONTROL_REGIONS
            ), (rank, files)
            # every rank maps every rank's files: W of each control region, and nothing else
            for left in (r["released_files"], r["forward_only_released_files"]):
                assert sorted(m.region for m in left) == sorted([*CONTROL_REGIONS] * WORLD), (rank, left)
                assert sum(m.nbytes for m in left if m.owner == rank) == released.control, rank
            files = r["forward_only_files"]
            assert fwd.published == files["odc.params"] + files["odc.published"] and "odc.grads" not in files, rank
        else:
            # the regions are counted as the driver holds them, each its private pool's segment (2 MiB granules):
            # at least what building allocates and releasing frees, the ones vector aside (512-byte blocks)
            for change in (r["build_allocated"], r["release_freed"]):
                assert -512 < built.regions - change < 3 * (2 << 20), (rank, change, built.regions)
            mapped = r["mapped_built"] - r["mapped_released"]
            assert mapped == (WORLD - 1) * (built.published + built.accumulator), (rank, mapped)
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@needs_gpu
def test_gpu_backward_peak_against_stock_fsdp2_and_the_rebuild(tmp_path):
    """benchmarks/bench_memory_gpu.py, 2 and 3 ranks sharing the GPU: ODC's backward's peak under a lagging
    accumulate stream is no higher than stock FSDP2's under as lagging a reduce-scatter stream; rebuilt after
    expandable segments were turned on, the regions are in plain segments and the model trains. (Memory after
    offload against FSDP2: odc-check's memory check, tests/check.)"""
    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, str(BENCH), "--json", str(out)], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for world, figures in json.loads(out.read_text()).items():
        assert all(figures["goals"].values()), (world, figures["goals"])
        for o in figures["odc"]:
            assert o["elsewhere_expandable"], world  # the setting took: the model's memory went expandable


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the benchmark says on a machine without a GPU")
def test_the_gpu_memory_benchmark_measures_nothing_without_a_gpu():
    run = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True)
    assert run.returncode == 0 and "nothing measured: no GPU" in run.stdout, run.stdout + run.stderr


def test_a_forward_only_pass_of_a_trained_model_holds_the_published_copy_alone():
    """3 shm ranks, bf16 mixed precision: a forward-only pass built with build(backward=False) adds the
    published copy alone (2 bytes per parameter and its flag) and no accumulator, where build() allocated the
    fp32 accumulator too; the pass that trains builds it, and it is then `.grad`'s storage."""
    seqs = workers.make_sequences(6, seed=35)
    for rank, m in enumerate(run_ranks(memory_workers.forward_only_passes_of_a_trained_model, WORLD, seqs)):
        forward, trained = m["forward-only"], m["trained"]
        before = m["forward-only, accumulator built"]
        print(
            f"rank {rank}: extra bytes per parameter, forward-only pass {forward.extra_bytes_per_param:.3f} "
            f"(accumulator built: {before.extra_bytes_per_param:.3f}), trained {trained.extra_bytes_per_param:.3f}"
        )
        assert forward.accumulator == 0 and 2.0 <= forward.extra_bytes_per_param < 2.1, (
            forward
        )  # shards padded to equal sizes
        assert trained.accumulator > 0 and trained.grad_storage > 0, trained
        assert before.accumulator > 0 and forward.held < before.held, (forward, before)
