"""ODC reads FSDP's reduce-scatter input after FSDP has let go of it: the hook keeps it until the
accumulates reading it are issued, and on a GPU until the compute stream waits for them.

FSDP2 records its reduce-scatter event right after the custom reduce-scatter returns, and once the
compute stream has passed that event the buffer may be handed out again; ODC's accumulates are issued
later, from the post-accumulate-grad hooks, on the reduce-scatter stream. So ODC holds the input, with an
event recorded after its accumulates, until the next reduce-scatter makes the compute stream wait for that
event (collectives.py, ScatterAccumulate). Without it a lagging reduce-scatter stream would read a buffer the next
layer's backward already writes into. (The memory this bound keeps: tests/fsdp/test_odc_memory.py.)
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from odc_plugin.launch import run_ranks

from . import stream_workers, workers
from .test_odc_core import random_plan, reference_grads


def test_the_hook_holds_the_reduce_scatter_input_until_its_accumulates_are_issued():
    seqs = workers.make_sequences(9, seed=51)
    plan = random_plan(len(seqs), [3, 1, 2], seed=51)
    results = run_ranks(stream_workers.watched_grads, 3, seqs, plan, "cpu", 0)
    expected = reference_grads(seqs)
    for rank, r in enumerate(results):
        assert r["accumulates"] > 0 and r["all_held"], (rank, r["accumulates"])
        assert not r["held_after_end"], rank
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and Triton (the cuda_ipc transport): the hazard is between CUDA streams",
)
# 2 ranks on the GPU(s) over CUDA IPC, 8 one-sequence micro-batches each (short: the next layer's backward
# starts while the last accumulates still wait), the reduce-scatter stream delayed ~10 ms before every
# accumulate: longer than the host takes to reach the next layer's reduce-scatter, so that without the
# bookkeeping that layer's copy-in reliably lands in the buffer still to be read (at ~1 ms it did in 2 runs
# of 3 on an H100)
LAGGING = dict(seqs=workers.make_sequences(16, seed=52, max_len=12), delay_cycles=20_000_000)
LAGGING["plan"] = [[[i] for i in range(8)], [[i] for i in range(8, 16)]]


def _lagging_run(stream_bookkeeping: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    seqs, plan, delay = LAGGING["seqs"], LAGGING["plan"], LAGGING["delay_cycles"]
    results = run_ranks(stream_workers.watched_grads, 2, seqs, plan, "cuda", delay, stream_bookkeeping)
    return results, reference_grads(seqs, "cuda")


def _worst_relative_difference(grads: dict, expected: dict) -> float:
    return max(((grads[n] - e).abs().max() / e.abs().max().clamp_min(1e-12)).item() for n, e in expected.items())


@needs_gpu
def test_gradients_stay_exact_when_the_reduce_scatter_stream_lags_behind_compute():
    """The lagging reduce-scatter stream: the gradients equal one process's (which is stock FSDP2's math)
    on the same GPU."""
    results, expected = _lagging_run(stream_bookkeeping=True)
    for rank, r in enumerate(results):
        assert r["all_held"], rank
        print(f"rank {rank}: worst relative difference {_worst_relative_difference(r['grads'], expected):.2e}")
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@needs_gpu
def test_negative_control_without_the_stream_bookkeeping_the_lagging_stream_corrupts_gradients():
    """The same run with ODC letting go of each reduce-scatter input once its accumulates are issued (no
    wait of the compute stream): the allocator hands it out again while accumulates queued on the lagging
    stream still read it, so the gradients differ from one process's. Shows that the test above can fail,
    and that the bookkeeping is what passes it."""
    results, expected = _lagging_run(stream_bookkeeping=False)
    worst = [_worst_relative_difference(r["grads"], expected) for r in results]
    print(f"without stream bookkeeping: worst relative difference per rank {[f'{w:.2e}' for w in worst]}")
    assert max(worst) > 1e-3, worst
