"""ODC on FSDP2: FSDP's collectives replaced by one-sided gets and accumulates."""

from .odc import MiniBatchStats, ODCConfig, OnDemandComm, apply_odc

__all__ = ["MiniBatchStats", "ODCConfig", "OnDemandComm", "apply_odc"]
