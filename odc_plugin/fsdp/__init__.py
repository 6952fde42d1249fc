"""ODC on FSDP2: FSDP's collectives replaced by one-sided gets and accumulates."""

from ..comm import ODCError, ODCPeerFailedError, ODCTimeoutError
from .config import MiniBatchStats, ODCConfig
from .mesh import DataParallelMesh, data_parallel_mesh, shard_group
from .odc import OnDemandComm, apply_odc

__all__ = [
    "DataParallelMesh",
    "MiniBatchStats",
    "ODCConfig",
    "ODCError",
    "ODCPeerFailedError",
    "ODCTimeoutError",
    "OnDemandComm",
    "apply_odc",
    "data_parallel_mesh",
    "shard_group",
]
