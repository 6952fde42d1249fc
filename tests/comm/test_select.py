"""Which transport "auto" picks, and make_transport's handling of the GPU kinds on a CPU machine."""

import pytest
import torch

from odc_plugin.comm.select import choose_transport, flat_nvshmem_error, peer_transports
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
        (["n0"] * 4, "cpu", "shm"),
    ],
    ids=["gpu-1rank", "gpu-1node", "cpu-1node"],
)
def test_one_transport_for_the_group(hosts, device, expected):
    assert choose_transport(hosts, device) == expected


@pytest.mark.parametrize("hosts", [["n0"] * 8 + ["n1"], ["n1", "n0"]], ids=["gpu-2nodes-uneven", "gpu-2nodes"])
def test_flat_nvshmem_across_nodes_is_refused_pointing_to_hsdp(hosts):
    with pytest.raises(ValueError) as e:
        choose_transport(hosts, "cuda")
    msg = str(e.value)
    assert msg == flat_nvshmem_error(hosts)
    assert msg.startswith("flat ODC across nodes is not offered: one NVSHMEM transport over ranks on 2 nodes (n0, n1)")
    assert "set fsdp_size to the GPUs per node (HSDP" in msg and "\n" not in msg


def test_the_nvshmem_transport_refuses_ranks_on_several_nodes_on_every_rank():
    # before NVSHMEM or CUDA are touched, so this runs on CPU ranks (two simulated nodes)
    hosts = ["node-a", "node-a", "node-b"]
    for msg in run_ranks(transport_workers.nvshmem_on_nodes, 3, hosts):
        assert msg == flat_nvshmem_error(hosts)


def test_flat_nvshmem_on_one_node_is_allowed_and_many_nodes_are_named_briefly():
    assert flat_nvshmem_error(["n0"] * 8) is None
    msg = flat_nvshmem_error([f"n{i}" for i in range(16)])
    assert "16 nodes (n0, n1, n10, n11 and 12 more)" in msg


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
