"""The start-up check of peer atomics (odc_plugin/comm/peer_atomics.py): its decision on CPU, from
findings, and the whole check over the shm transport at 3 ranks, exact or losing one pair's updates. Its
run on GPUs over cuda_ipc, with its time, is in test_gpu_cuda_ipc.py."""

from __future__ import annotations

from odc_plugin.comm.peer_atomics import Mismatch, probe_error
from odc_plugin.launch import run_ranks

from . import transport_workers

GPUS = ["GPU-a", "GPU-b", "GPU-c"]
UNKNOWN = [[None] * 3] * 3
ADVICE = "set odc_accumulate=slots or auto (adds without peer atomics), or use strategy=fsdp2"


def test_exact_sums_and_no_refusal_from_cuda_pass():
    assert probe_error([], GPUS, UNKNOWN) is None
    assert probe_error([], GPUS, [[None, True, True], [True, None, True], [True, True, None]]) is None


def test_a_wrong_sum_names_the_pair_of_gpus_in_one_line():
    found = [Mismatch(2, None, 7, 40.0, 38.0), Mismatch(2, 1, 3, 8.0, 6.0)]
    error = probe_error(found, GPUS, UNKNOWN)
    assert error == (
        "cuda_ipc: the start-up check of peer atomics failed: adds from rank 1's GPU GPU-b into rank 2's GPU GPU-c "
        "gave 6 where 8 was added (element 3; 2 range(s) wrong): these GPUs lack native peer atomics (e.g. PCIe "
        f"without NVLink), so gradients added into a peer's memory can be wrong; {ADVICE}"
    )
    shared_only = probe_error([Mismatch(0, None, 5, 24.0, 20.0)], GPUS, UNKNOWN)
    assert "adds from every rank at once into rank 0's GPU GPU-a gave 20 where 24 was added" in shared_only
    assert "\n" not in error + shared_only


def test_cuda_reporting_no_native_atomics_is_refused_even_when_the_sums_came_out_right():
    native = [[None, True, True], [True, None, False], [True, True, None]]
    error = probe_error([], GPUS, native)
    assert error.startswith("cuda_ipc: CUDA reports no native atomics from rank 1's GPU GPU-b to rank 2's GPU GPU-c")
    assert error.endswith(ADVICE)


def test_the_check_over_three_shm_ranks_passes_with_exact_adds_and_fails_every_rank_alike_when_a_pair_loses_one():
    assert run_ranks(transport_workers.peer_atomics_check, 3, None) == ["passed"] * 3
    errors = run_ranks(transport_workers.peer_atomics_check, 3, (1, 2))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith(
        "shm: the start-up check of peer atomics failed: adds from rank 1's GPU GPU-1 into rank 2's GPU GPU-2 "
        "gave 0 where 8 was added (element 0; 2 range(s) wrong)"
    ), errors[0]


def test_under_slots_cuda_s_answer_about_atomics_does_not_matter_and_a_wrong_sum_names_the_method():
    native = [[None, False, False], [False, None, False], [False, False, None]]
    assert probe_error([], GPUS, native, "slots") is None
    error = probe_error([Mismatch(2, 1, 3, 8.0, 6.0)], GPUS, native, "slots")
    assert error.startswith(
        "cuda_ipc: the start-up check of peer adds (odc_accumulate=slots) failed: adds from rank 1's GPU GPU-b into "
        "rank 2's GPU GPU-c gave 6 where 8 was added"
    )
    assert error.endswith("use strategy=fsdp2") and "\n" not in error


def test_the_check_of_slots_over_three_shm_ranks_passes_and_fails_every_rank_alike_when_a_pair_loses_one():
    assert run_ranks(transport_workers.peer_atomics_check, 3, None, "slots") == ["passed"] * 3
    errors = run_ranks(transport_workers.peer_atomics_check, 3, (1, 2), "slots")
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith(
        "shm: the start-up check of peer adds (odc_accumulate=slots) failed: adds from rank 1's GPU GPU-1 into "
        "rank 2's GPU GPU-2 gave 0 where 8 was added (element 0; 2 range(s) wrong)"
    ), errors[0]
