"""Which ranks ODC connects, read from the device mesh a model was sharded over.

`fully_shard` over a 1-D mesh shards every parameter over all its ranks (FSDP). Over a 2-D mesh
(replicate x shard) it shards over the second dim and keeps one replica per index of the first (HSDP):
typically one shard group per node. ODC then gets and accumulates only inside the shard group, so its
transport spans that group, and the replicas meet once per mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class DataParallelMesh:
    """shard_group: the ranks that together hold one copy of the model (the transport spans them).
    replicate_group: this rank's peers holding the same shard in the other replicas; None without HSDP.
    ranks: every data-parallel rank, all replicas, as global ranks.
    """

    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    ranks: tuple[int, ...]

    @property
    def num_replicas(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)


def data_parallel_mesh(model: nn.Module) -> DataParallelMesh:
    """The mesh every parameter of a `fully_shard`-ed `model` lives on, as shard and replicate groups."""
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if len(meshes) != 1:
        raise ValueError(
            f"ODC needs every parameter sharded by fully_shard over one device mesh; found {len(meshes)} meshes"
        )
    mesh = meshes.pop()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"ODC takes a 1-D (FSDP) or 2-D (replicate x shard, HSDP) mesh, got a {mesh.ndim}-D one")
    ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    if mesh.ndim == 1:
        return DataParallelMesh(mesh.get_group(0), None, ranks)
    # fully_shard's HSDP layout: dim 0 replicates, dim 1 shards.
    return DataParallelMesh(mesh.get_group(1), mesh.get_group(0), ranks)


def shard_group(model: nn.Module) -> dist.ProcessGroup:
    """The process group to build ODC's transport over: `make_transport(kind, group=shard_group(model))`."""
    return data_parallel_mesh(model).shard_group
