"""Which transport "auto" picks, and make_transport's handling of the GPU kinds on a CPU machine."""

import pytest
import torch

from odc_plugin.comm.select import choose_transport, peer_transports
from odc_plugin.launch import run_ranks

from . import transport_workers


def test_peers_on_the_same_node_use_cuda_ipc_the_rest_go_remote():
    hosts = ["a", "a", "b", "b"]
    assert peer_transports(hosts, 0, "cuda") == ["cuda_ipc", "cuda_ipc", "nvshmem", "nvshmem"]
    assert peer_transports(hosts, 3, "cuda") == ["nvshmem", "nvshmem", "cuda_ipc", "cuda_ipc"]
    assert peer_transports(hosts, 1, "cpu") == ["shm", "shm", "none", "none"]


# explicit ids: `-k "not shm"` would drop any test whose id contains "shm" (nvshmem included)
@pytest.mark.parametrize(
    "hosts,device,expected",
    [
        (["n0"], "cuda", "cuda_ipc"),
        (["n0"] * 8, "cuda", "cuda_ipc"),
        (["n0"] * 8 + ["n1"], "cuda", "nvshmem"),
        (["n0", "n1"], "cuda", "nvshmem"),
        (["n0"] * 4, "cpu", "shm"),
    ],
    ids=["gpu-1rank", "gpu-1node", "gpu-2nodes-uneven", "gpu-2nodes", "cpu-1node"],
)
def test_one_transport_for_the_group(hosts, device, expected):
    assert choose_transport(hosts, device) == expected


def test_cpu_across_machines_is_a_clear_error():
    with pytest.raises(ValueError, match=r"one machine .*\['n0', 'n1'\]"):
        choose_transport(["n0", "n1", "n0"], "cpu")


def test_bad_inputs():
    with pytest.raises(ValueError, match="device type 'xpu'"):
        choose_transport(["n0"], "xpu")
    with pytest.raises(ValueError, match="rank 2 out of range"):
        peer_transports(["n0", "n0"], 2, "cuda")
    with pytest.raises(ValueError, match="no ranks"):
        choose_transport([], "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors a machine without CUDA gives")
def test_make_transport_on_cpu():
    (res,) = run_ranks(transport_workers.make_on_cpu, 1)
    assert res["auto"] == "ShmTransport"
    assert res["cuda_ipc"] == "RuntimeError: the cuda_ipc transport needs CUDA; on CPU use 'shm'"
    assert res["nvshmem"] == "RuntimeError: the nvshmem transport needs CUDA; on CPU use 'shm'"
    assert res["shm_options"].startswith("TypeError: the shm transport takes no options")
