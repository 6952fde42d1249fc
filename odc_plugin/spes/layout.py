"""Which rank is which node: the process groups SPES and the in-node sharding run over.

Global rank g is local rank g % R of node g // R (R ranks per node). Inside a node the ranks shard the
model (FSDP2 or ODC) over `node_group`. Across nodes, SPES runs over `cross_group`: the ranks with this
local rank, one per node. Since every node shards the same model the same way, those ranks hold the
same shard of every parameter, so R such groups sync the whole model in parallel, each moving 1/R of it,
without gathering it onto one rank per node first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class NodeLayout:
    num_nodes: int
    ranks_per_node: int
    node: int
    local_rank: int
    cross_group: dist.ProcessGroup  # this local rank of every node, in node order
    node_group: dist.ProcessGroup | None  # this node's ranks; None with one rank per node
    node_mesh: DeviceMesh | None  # the same ranks as a mesh, for fully_shard


def node_layout(ranks_per_node: int = 1, timeout_s: float = 600.0, device: str = "cpu") -> NodeLayout:
    """Build the groups (collective over the default group: every rank calls it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node must divide the world size {world}, got {ranks_per_node}")
    nodes = world // ranks_per_node
    timeout = timedelta(seconds=timeout_s)
    node, local = divmod(rank, ranks_per_node)
    cross, _ = dist.new_subgroups_by_enumeration(
        [[p * ranks_per_node + r for p in range(nodes)] for r in range(ranks_per_node)], timeout=timeout
    )
    node_group = node_mesh = None
    if ranks_per_node > 1:
        node_group, _ = dist.new_subgroups_by_enumeration(
            [[p * ranks_per_node + r for r in range(ranks_per_node)] for p in range(nodes)], timeout=timeout
        )
        node_mesh = DeviceMesh.from_group(node_group, device)
    return NodeLayout(nodes, ranks_per_node, node, local, cross, node_group, node_mesh)
