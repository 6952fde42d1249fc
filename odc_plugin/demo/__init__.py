"""`odc-demo`: the four A/B rows (stock FSDP2, lockstep on ODC's transport, ODC+LB-Micro, ODC+LB-Mini)
trained by real CPU processes, with real or emulated layer compute, one run or a sweep over rank counts."""

from .cli import main

__all__ = ["main"]
