"""What the cuda_ipc transport decides when it starts, from every rank's report (pure; no GPU needed):
one node, no expandable_segments, and how a peer whose GPU Ray hid from this process is handled."""

import pytest
import torch

from odc_plugin.comm.cuda_ipc_setup import (
    RAY_NOSET,
    ProcessGpus,
    expandable_segments_on,
    hidden_peers,
    open_error,
    setup_error,
)

GPUS = [f"GPU-{i}" for i in range(4)]


def report(gpu=0, visible=(0, 1, 2, 3), cuda_visible_devices=None, alloc_conf=(), host="node0"):
    return ProcessGpus(host, GPUS[gpu], tuple(GPUS[i] for i in visible), cuda_visible_devices, tuple(alloc_conf))


def all_visible(world=4):
    return [report(gpu=r) for r in range(world)]


def ray_workers(world=4):
    """verl under Ray by default: each worker's CUDA_VISIBLE_DEVICES names its own GPU only."""
    return [report(gpu=r, visible=(r,), cuda_visible_devices=str(r)) for r in range(world)]


def test_every_gpu_visible_or_one_shared_gpu_is_fine():
    assert setup_error(all_visible()) is None
    assert hidden_peers(all_visible(), 2) == []
    shared = [report(gpu=0, visible=(0,)) for _ in range(3)]  # the tests: ranks as processes on one GPU
    assert setup_error(shared) is None and hidden_peers(shared, 1) == []


def test_one_gpu_per_worker_is_mapped_as_cuda_allows():
    ranks = ray_workers()
    assert setup_error(ranks) is None  # no refusal up front: CUDA opens handles of GPUs a process does not see
    assert hidden_peers(ranks, 1) == [0, 2, 3]


def test_a_refused_mapping_of_a_hidden_gpu_names_the_ray_setting():
    cause = "CUDA error: peer access is not supported between these two devices\nCUDA kernel errors might be ..."
    msg = open_error(ray_workers(), 1, 2, "odc.grads", cause)
    assert "\n" not in msg
    assert msg.startswith(
        "cuda_ipc: rank 1 cannot map rank 2's region 'odc.grads' (CUDA error: peer access is not supported "
        "between these two devices): rank 2's GPU is not visible to rank 1's process (CUDA_VISIBLE_DEVICES=1,"
    )
    assert f"set {RAY_NOSET}=1" in msg
    # a visible peer's refusal is about peer access, not about Ray
    msg = open_error(all_visible(), 1, 2, "odc.grads", "")
    assert msg == (
        "cuda_ipc: rank 1 cannot map rank 2's region 'odc.grads' (unknown error): the GPUs of the node must "
        "support peer access between them; otherwise use the 'nvshmem' transport"
    )


def test_ranks_on_several_nodes_are_refused_pointing_to_hsdp():
    ranks = all_visible(2) + [report(gpu=0, host="node1")]
    msg = setup_error(ranks)
    assert msg.startswith("the cuda_ipc transport needs every rank on one node, got ['node0', 'node1']")
    assert "fsdp_size" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "conf,on",
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments : True", True),
        ("expandable_segments:False", False),
        ("expandable_segments:True,expandable_segments:False", False),  # the last one wins, as in torch
        ("backend:native,garbage_collection_threshold:0.6", False),
        ("", False),
    ],
)
def test_expandable_segments_read_as_torch_reads_them(conf, on):
    assert expandable_segments_on(conf) is on


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_expandable_segments_on_any_rank_are_refused_naming_the_setting(var):
    ranks = all_visible()
    ranks[3] = report(gpu=3, alloc_conf=[(var, "max_split_size_mb:64,expandable_segments:True")])
    msg = setup_error(ranks)
    assert msg.startswith(f"cuda_ipc: rank 3 runs with {var}='max_split_size_mb:64,expandable_segments:True'")
    assert "pidfd_getfd" in msg and "expandable_segments:False" in msg and "\n" not in msg
    ranks[3] = report(gpu=3, alloc_conf=[(var, "expandable_segments:False")])
    assert setup_error(ranks) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="ProcessGpus.here reads the GPUs' UUIDs: needs a CUDA GPU")
def test_a_report_reads_the_allocator_settings_and_visible_devices_from_the_environment():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "", "CUDA_VISIBLE_DEVICES": "3"}
    here = ProcessGpus.here(0, env)
    assert here.alloc_conf == (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
    assert here.cuda_visible_devices == "3" and here.gpu in here.visible
