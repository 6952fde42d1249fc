"""What SPES runs: the mode (SPES or one of its two baselines), the sync period, the outer optimizer and
the merging warm-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Mode = Literal["spes", "fedavg", "centralized"]
OuterKind = Literal["nesterov", "none"]
MODES: tuple[str, ...] = get_args(Mode)
OUTER_OPTIMIZERS: tuple[str, ...] = get_args(OuterKind)


@dataclass(frozen=True)
class SPESConfig:
    """`spes`: every node trains the shared parameters and its own experts; every `sync_every` steps the
    shared parameters are averaged and each expert is taken from its owner. `fedavg`: every node trains
    everything and the whole model is averaged every `sync_every` steps (FedAvg; DiLoCo with the outer
    optimizer). `centralized`: plain data parallelism, gradients all-reduced every step. The outer
    optimizer acts alike in `spes` and `fedavg`.

    Merging defaults are those of the reference's cluster launch (run_scripts/run_cluster.sh); its
    sync period is `sync_steps: 100` in its node configs.
    """

    mode: Mode = "spes"
    """spes, or a baseline: fedavg (full-model averaging) or centralized (all-reduced gradients)."""
    sync_every: int = 100
    """Local optimizer steps between syncs (spes, fedavg)."""
    outer_optimizer: OuterKind = "none"
    """nesterov: step the weights of the last sync along the synced change with Nesterov momentum
    (DiLoCo's outer SGD); none: take the synced weights as they are (the reference's plain average)."""
    outer_lr: float = 0.7
    """The outer step's learning rate: 1 with no momentum is the plain average (DiLoCo: 0.7)."""
    outer_momentum: float = 0.9
    """The outer step's Nesterov momentum, in [0, 1) (DiLoCo: 0.9)."""
    merge_interval: int = 500
    """Merge experts on sync steps that are a multiple of this."""
    merge_alpha_start: float = 0.05
    """The merging strength at step 0; 0 turns merging off."""
    merge_decay_steps: int = 20000
    """Alpha falls linearly to 0 over this many steps."""
    merge_topk: int = 4
    """Donors per expert: the most similar experts of its layer."""
    sync_timeout_s: float = 600.0
    """A node waiting longer than this in a sync fails."""

    def __post_init__(self):
        for key, choices in (("mode", MODES), ("outer_optimizer", OUTER_OPTIMIZERS)):
            if getattr(self, key) not in choices:
                raise ValueError(f"{key} must be one of {', '.join(choices)}, got '{getattr(self, key)}'")
        for key in ("sync_every", "merge_interval", "merge_decay_steps", "merge_topk"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.merge_alpha_start <= 1.0:
            raise ValueError(f"merge_alpha_start must be in [0, 1], got {self.merge_alpha_start}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not self.sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {self.sync_timeout_s}")

    @property
    def merging(self) -> bool:
        # Merging exists for experts a node never trains; the baselines train every expert everywhere.
        return self.mode == "spes" and self.merge_alpha_start > 0

    @property
    def outer(self) -> bool:
        return self.mode != "centralized" and self.outer_optimizer != "none"
