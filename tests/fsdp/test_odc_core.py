"""ODC on FSDP2 against a single-process reference and against stock FSDP2 (real gloo ranks).

The single-process comparisons also run on a GPU when there is one: ODC over CUDA IPC, every rank a
process on the same GPU. Stock FSDP2 itself is compared on CPU only: its collectives need NCCL on a GPU,
and NCCL takes one rank per GPU.
"""

from __future__ import annotations

import glob
import importlib.util
import random
import re
import time

import pytest
import torch

from odc_plugin.launch import RankFailed, run_ranks
from odc_plugin.models import build_qwen2, token_mean_loss

from ..weights import assert_trained, assert_weights_agree
from . import workers

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
            reason="needs a CUDA GPU and Triton (the `gpu` extra) for the cuda_ipc transport",
        ),
    ),
]


def random_plan(n_samples: int, mb_counts: list[int], seed: int) -> list[list[list[int]]]:
    """Split samples 0..n-1 randomly over ranks, rank r into mb_counts[r] non-empty micro-batches."""
    rng = random.Random(seed)
    order = list(range(n_samples))
    rng.shuffle(order)
    busy = [r for r, c in enumerate(mb_counts) if c]
    # every micro-batch gets one sample, the rest land anywhere on the busy ranks
    slots = [(r, m) for r in busy for m in range(mb_counts[r])]
    assert len(slots) <= n_samples
    plan = [[[] for _ in range(c)] for c in mb_counts]
    for i, sample in enumerate(order):
        r, m = slots[i] if i < len(slots) else rng.choice(slots)
        plan[r][m].append(sample)
    return plan


def reference_grads(seqs, device="cpu") -> dict[str, torch.Tensor]:
    model = build_qwen2("tiny", seed=0).to(device)
    token_mean_loss(model, workers.on_device(seqs, device), workers.count_targets(seqs), world_size=1).backward()
    return {n: p.grad.cpu() for n, p in model.named_parameters()}


def reference_train_steps(seqs, steps, device="cpu", arch="qwen2") -> dict[str, torch.Tensor]:
    """workers.train_steps in one process on the whole batch: what every data-parallel run must match."""
    model = workers.MODELS[arch]().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    seqs = workers.on_device(seqs, device)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        token_mean_loss(model, seqs, workers.count_targets(seqs), world_size=1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mb_counts,seed",
    [([5, 1], 0), ([2, 0, 3], 1), ([1, 4, 0, 2], 2)],
    ids=["2ranks-5vs1", "3ranks-one-idle", "4ranks-one-idle"],
)
def test_gradients_equal_single_process_reference(mb_counts, seed, device):
    seqs = workers.make_sequences(16, seed)
    plan = random_plan(len(seqs), mb_counts, seed)
    per_rank = run_ranks(workers.odc_grads, len(mb_counts), seqs, plan, device)
    expected = reference_grads(seqs, device)
    for rank_grads, sizes in per_rank:
        # FSDP-like memory: the published shard and the accumulator hold this rank's shard (plus at most
        # one row of padding per parameter), not the model
        world = len(mb_counts)
        assert sizes["grads_numel"] <= sizes["model_numel"] / world + sizes["padding_bound"]
        assert sizes["params_bytes"] == 4 * sizes["grads_numel"]  # fp32 gathers
        assert rank_grads.keys() == expected.keys()
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16-params-fp32-reduce"])
def test_parameters_equal_stock_fsdp2_after_adamw_steps(mixed_precision):
    seqs = workers.make_sequences(12, seed=3)
    plan = random_plan(len(seqs), [2, 2, 2], seed=3)  # stock FSDP2 needs equal micro-batch counts
    odc = run_ranks(workers.train_steps, 3, seqs, plan, 5, True, mixed_precision)
    fsdp = run_ranks(workers.train_steps, 3, seqs, plan, 5, False, mixed_precision)
    initial = {n: p.detach() for n, p in build_qwen2("tiny", seed=0).named_parameters()}
    assert_trained(fsdp[0], initial)
    if not mixed_precision:
        for name, value in fsdp[0].items():
            torch.testing.assert_close(odc[0][name], value, rtol=1e-5, atol=1e-6, msg=name)
        return
    # Under bf16 gathers a master weight on a bf16 rounding edge can round the other way (tests/weights.py);
    # even those stay within one small Adam step.
    assert_weights_agree(odc[0], fsdp[0], 1e-4, "bf16 params")


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_equal_single_process_adamw_steps(device):
    """Uneven micro-batch counts and an idle rank, which stock FSDP2 cannot run, against one process."""
    seqs = workers.make_sequences(12, seed=6)
    plan = random_plan(len(seqs), [4, 1, 0], seed=6)
    odc = run_ranks(workers.train_steps, 3, seqs, plan, 5, True, False, device)
    expected = reference_train_steps(seqs, 5, device)
    for name, value in expected.items():
        torch.testing.assert_close(odc[0][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("methods", [None, ["slots"]], ids=["calibrated", "slots"])
def test_after_a_calibration_the_chosen_accumulate_method_trains_as_one_process(methods):
    seqs = workers.make_sequences(12, seed=6)
    plan = random_plan(len(seqs), [4, 1, 0], seed=6)
    results = run_ranks(workers.calibrated_train_steps, 3, seqs, plan, 3, methods)
    expected = reference_train_steps(seqs, 3)
    params, calibration, memory = results[0]
    assert all(c == calibration for _, c, _ in results)
    # the model's FSDP groups: the root's and the two decoder layers' (one size), one rank's shard of each
    assert sorted(b.count for b in calibration.buckets) == [1, 2]
    assert sorted(calibration.accumulate_s) == sorted(methods or ["direct", "slots"])
    assert calibration.reduce_bytes == 4 * sum(b.numel * b.count for b in calibration.buckets)
    # the accumulator (gradients and a used flag per parameter) was built with the chosen method: under
    # slots, one more copy of it per peer
    copies = 3 if calibration.chosen == "slots" else 1
    flags = len(list(build_qwen2("tiny", seed=0).parameters()))
    assert memory.accumulator == copies * (calibration.reduce_bytes + 4 * flags)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_moe_with_an_expert_one_rank_routes_nothing_to_equals_single_process_adamw_steps():
    """The tiny Qwen3-MoE (experts stacked in one tensor per layer, as transformers 5 builds them, 5 experts
    over 3 ranks: padded shards), uneven micro-batch counts; rank 2 trains one short sequence, so some of
    its layers' experts get none of its tokens while the other ranks' tokens reach them."""
    seqs = workers.make_sequences(12, seed=15)  # the shortest of 4 tokens
    shortest = min(range(len(seqs)), key=lambda i: len(seqs[i]))
    rest = [i for i in range(len(seqs)) if i != shortest]
    plan = [[rest[0:2], rest[2:4], rest[4:6], rest[6:8]], [rest[8:9], rest[9:]], [[shortest]]]
    results = run_ranks(workers.train_moe_steps, 3, seqs, plan, 4)
    counts = [torch.stack(c) for _, c in results]  # per rank: [steps, layers, experts]
    idle_on_2 = (counts[2][0] == 0) & (counts[0][0] + counts[1][0] > 0)
    assert idle_on_2.any(), counts[2][0]
    print(f"step 1, tokens per expert (layer 0) on ranks 0, 1, 2: {[c[0, 0].tolist() for c in counts]}")
    expected = reference_train_steps(seqs, 4, arch="qwen3_moe")
    initial = dict(workers.MODELS["qwen3_moe"]().named_parameters())
    for name, value in expected.items():
        assert not torch.equal(value, initial[name].detach()), f"{name} did not train"
    # Expert gradients summed in ODC's arrival order: on an AVX512-bf16 CPU (CI's) one expert weight of
    # 20,424 lands 1.08e-6 from the reference, just past rtol 1e-5 (tests/weights.py).
    print(assert_weights_agree(results[0][0], expected, 1e-5, "moe"))


def test_an_exception_in_a_minibatch_fails_the_peers_at_once_and_the_rank_can_begin_again():
    seqs = workers.make_sequences(9, seed=5)
    plan = random_plan(len(seqs), [2, 1, 2], seed=5)
    results = run_ranks(workers.raise_mid_minibatch, 3, seqs, plan, 1)
    outcome, _, retried = results[1]
    assert outcome == "RuntimeError: simulated out of memory" and retried
    for rank in (0, 2):
        outcome, elapsed, _ = results[rank]
        assert outcome == (
            f"ODCPeerFailedError: rank {rank}: rank 1 failed in its mini-batch: RuntimeError: simulated out of memory"
        ), outcome
        assert elapsed < 5, elapsed  # not the 600 s barrier timeout
    print(f"peers failed after {results[0][1]:.2f} s and {results[2][1]:.2f} s")


def test_no_collective_between_begin_and_end():
    seqs = workers.make_sequences(8, seed=4)
    plan = random_plan(len(seqs), [2, 2], seed=4)
    odc_calls = run_ranks(workers.count_collectives_in_minibatch, 2, seqs, plan, True)
    fsdp_calls = run_ranks(workers.count_collectives_in_minibatch, 2, seqs, plan, False)
    # The counter sees stock FSDP2's collectives, so seeing none under ODC means there were none.
    # (names differ between torch versions: all_gather_single / all_gather_into_tensor, ...)
    assert all(any("all_gather" in n for n in c) and any("reduce_scatter" in n for n in c) for c in fsdp_calls)
    assert odc_calls == [[], []]


def test_killed_rank_makes_the_others_time_out_naming_it():
    seqs = workers.make_sequences(9, seed=5)
    plan = random_plan(len(seqs), [1, 2, 1], seed=5)
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(workers.die_mid_minibatch, 3, seqs, plan, 1, 3.0, timeout_s=120)
    message = str(info.value)
    assert message.startswith("rank 1 failed: exited with code 17 and left no result"), message
    # a survivor ends its wait when it sees rank 1's process gone, or at its timeout if it looked first;
    # the other survivor is late too if it was still computing when this one gave up
    ended = r"(timed out after 3s|failed \(rank 1's process \(pid \d+\) has exited\))"
    for survivor, other in ((0, 2), (2, 0)):
        late = rf"\[(1|1, {other}|{other}, 1)\]"
        assert re.search(
            rf"ODCTimeoutError: rank {survivor}: ODC barrier #1 {ended}; rank\(s\) {late} did not arrive", message
        ), message
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("stage,victim", [("make_transport", 0), ("apply_odc", 1)])
def test_rank_killed_during_setup_leaves_no_shared_memory_files(stage, victim):
    with pytest.raises(RankFailed) as info:
        run_ranks(workers.die_during_setup, 3, victim, stage, timeout_s=120, failure_grace_s=20)
    message = str(info.value).splitlines()[0]  # every rank's error, then the first one's traceback
    assert re.search(rf"rank {victim}( failed)?: exited with code 17 and left no result", message), message
    prefixes = set(
        re.findall(r"RuntimeError: rank \d: setting up shared-memory region '[\w.]+' \((/dev/shm/odc-\w+)-", message)
    )
    # every survivor's set-up failed, naming the files it was setting up; none of them is left
    assert len(re.findall(r"setting up shared-memory region", message)) == 2, message
    assert len(prefixes) == 1, message
    assert glob.glob(f"{prefixes.pop()}*") == []
