"""ODC's memory over stock FSDP2, and its gradient accumulator as the storage of the sharded `.grad`.

Measured from the regions ODC allocates (`memory_bytes()`), on 3 shared-memory ranks: a forward-only
model (`ODCConfig(trains=False)`, the reference model) holds no gradient region, and a trained fp32
model's accumulator is its `.grad` (views), so under bf16 mixed precision both add only the published
bf16 shards to FSDP2's memory, about 2 bytes per parameter. Training through those views equals one
process's AdamW with gradient accumulation over mini-batches, both ways of zeroing, and a failed
mini-batch in between (which drops `.grad` on every rank, docs/design.md, "A failed mini-batch").
"""

from __future__ import annotations

import torch

from odc_plugin.launch import run_ranks

from ..weights import assert_weights_agree
from . import gradient_workers, workers
from .test_odc_core import random_plan, reference_grads, reference_train_steps

WORLD = 3


def test_extra_bytes_per_parameter_over_fsdp2_trained_and_forward_only():
    per_rank = run_ranks(gradient_workers.memory, WORLD)
    for rank, runs in enumerate(per_rank):
        for label, run in runs.items():
            m = run["memory"]
            print(
                f"rank {rank}, {label}: published {m.published} B, accumulator {m.accumulator} B, .grad it stands "
                f"for {m.grad_storage} B, {m.shard_numel} parameters: {m.extra_bytes_per_param:.3f} extra bytes "
                f"per parameter over FSDP2"
            )
        for label in ("bf16 mixed precision, forward-only", "fp32, forward-only"):
            m = runs[label]["memory"]
            assert not runs[label]["grads_region"] and m.accumulator == 0 and m.grad_storage == 0, label
            assert runs[label]["backward_refused"].startswith("this model was set up forward-only"), label
        # published shards in the gather dtype, plus at most one padding row per parameter; the trained
        # model's accumulator adds only its padding and used flags, the `.grad` it stands for taken off
        for label, gather_bytes in (("bf16 mixed precision", 2), ("fp32", 4)):
            forward_only = runs[f"{label}, forward-only"]["memory"].extra_bytes_per_param
            trained = runs[f"{label}, trained"]["memory"].extra_bytes_per_param
            assert gather_bytes <= forward_only < gather_bytes * 1.06, (label, forward_only)
            assert forward_only < trained < forward_only + 0.25, (label, trained)
        # bf16 parameters: `.grad` is a bf16 copy, the fp32 accumulator is extra
        m = runs["bf16 parameters, trained"]["memory"]
        assert m.grad_storage == 0 and 6 <= m.extra_bytes_per_param < 6.4, m


def test_accumulator_as_grad_storage_equals_one_process_with_accumulation_zeroing_and_a_failure():
    seqs = workers.make_sequences(12, seed=12)
    plans = [
        random_plan(6, [3, 0, 2], seed=12),
        [[[6 + i for i in mb] for mb in share] for share in random_plan(6, [1, 2, 2], seed=13)],
    ]
    failed_plan = random_plan(len(seqs), [1, 2, 1], seed=14)
    results = run_ranks(gradient_workers.accumulate_over_minibatches, WORLD, seqs, plans, failed_plan)
    expected_grads = reference_grads(seqs)
    expected = reference_train_steps(seqs, 2)
    for rank, seen in enumerate(results):
        assert seen["inside: zero"] and not seen["inside: in the accumulator"], rank
        assert seen["inside: storages"] == 1, seen["inside: storages"]  # FSDP keeps no gradient buffer
        assert seen["after: views of the accumulator"], rank
        for name, grad in seen["accumulated grads"].items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        assert seen["failed"].startswith("ODCPeerFailedError" if rank != 1 else "RuntimeError"), seen["failed"]
        assert seen["grads after the failure"] == [], seen["grads after the failure"]
        print(f"rank {rank}: {assert_weights_agree(seen['params'], expected, 1e-5, f'rank {rank}')}")


def test_bf16_parameters_get_bf16_gradient_copies_equal_to_stock_fsdp2():
    """bf16 parameters reduced in fp32, one micro-batch per rank (stock FSDP2 adds each further one into
    its bf16 `.grad`, rounding each time; ODC sums all in fp32): both sum the ranks in fp32, in different
    orders, and round once to bf16."""
    seqs = workers.make_sequences(8, seed=16)
    plan = random_plan(len(seqs), [1, 1, 1], seed=16)
    odc = run_ranks(gradient_workers.bf16_params_grads, WORLD, seqs, plan, True)
    fsdp = run_ranks(gradient_workers.bf16_params_grads, WORLD, seqs, plan, False)
    assert odc[0][1] == fsdp[0][1] == {"torch.bfloat16"}
    same = total = 0
    for name, grad in fsdp[0][0].items():
        got = odc[0][0][name]
        # one bf16 rounding step apart at most, where the fp32 sums straddle a rounding edge
        torch.testing.assert_close(got.float(), grad.float(), rtol=2**-7, atol=0, msg=name)
        same += int((got == grad).sum())
        total += grad.numel()
    print(f"bf16 gradients identical to stock FSDP2's in {same} of {total} elements")


def test_fsdp2_cpu_offload_trains_with_gradients_on_the_parameters_device():
    seqs = workers.make_sequences(9, seed=17)
    plan = random_plan(len(seqs), [2, 1, 2], seed=17)
    results = run_ranks(gradient_workers.offloaded_adamw_steps, WORLD, seqs, plan, 2)
    print(assert_weights_agree(results[0], reference_train_steps(seqs, 2), 1e-5, "offload_policy"))
