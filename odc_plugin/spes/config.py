"""What SPES runs: the mode (SPES or one of its two baselines), the sync period and the merging warm-up."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("spes", "fedavg", "centralized")


@dataclass(frozen=True)
class SPESConfig:
    """`spes`: every node trains the shared parameters and its own experts; every `sync_every` steps the
    shared parameters are averaged and each expert is taken from its owner. `fedavg`: every node trains
    everything and the whole model is averaged every `sync_every` steps (DiLoCo/FedAvg without an outer
    optimizer). `centralized`: plain data parallelism, gradients all-reduced every step.

    Merging defaults are those of the reference's cluster launch (run_scripts/run_cluster.sh); its
    sync period is `sync_steps: 100` in its node configs.
    """

    mode: str = "spes"
    sync_every: int = 100
    merge_interval: int = 500  # merge on sync steps that are a multiple of this
    merge_alpha_start: float = 0.05  # 0 turns merging off
    merge_decay_steps: int = 20000  # alpha falls linearly to 0 over this many steps
    merge_topk: int = 4  # donors per expert: the most similar experts of its layer
    sync_timeout_s: float = 600.0  # a node waiting longer than this in a sync fails

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        for key in ("sync_every", "merge_interval", "merge_decay_steps", "merge_topk"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.merge_alpha_start <= 1.0:
            raise ValueError(f"merge_alpha_start must be in [0, 1], got {self.merge_alpha_start}")
        if not self.sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {self.sync_timeout_s}")

    @property
    def merging(self) -> bool:
        # Merging exists for experts a node never trains; the baselines train every expert everywhere.
        return self.mode == "spes" and self.merge_alpha_start > 0
