"""Emulated layer compute: each decoder layer takes the time a GPU cost fit gives for the true lengths.

What ODC changes is when ranks wait, not how fast a layer computes. So a rehearsal at 4 to 32 ranks on a
2-core machine keeps everything real (FSDP2 modules with small real parameters, gloo collectives, ODC's
transport and barriers, the plans, gradients and the optimizer step) except the layers' arithmetic:
every decoder layer computes on short stand-in sequences, then sleeps until the fitted time of the
micro-batch's true sequences has passed, in forward and in backward, between FSDP's gather and
reduce-scatter of that layer (odc_plugin.layer_time). A sleeping rank takes no core, so 32 ranks can
wait at once on 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..balance.costs import CostCalibration, FitCost


@dataclass(frozen=True)
class EmulationFit:
    """Whole-model seconds of forward + backward for one sequence (`cost`), from a per-layer calibration
    file times the layer count of the model it was measured for, and how backward and forward share it."""

    cost: FitCost
    num_layers: int
    backward_ratio: float
    time_scale: float  # already in `cost`
    model: str  # the preset the fit was measured for
    source: str

    @classmethod
    def load(cls, path: str, time_scale: float = 1.0) -> EmulationFit:
        calibration = CostCalibration.load(path)
        layers = calibration.num_hidden_layers
        if not layers:
            raise ValueError(
                f"cost calibration {path!r}: model {calibration.model!r} is not a preset, so its layer count is unknown"
            )
        if not time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {time_scale}")
        scale = layers * time_scale
        return cls(
            FitCost(calibration.a * scale, calibration.b * scale),
            layers,
            calibration.backward_ratio,
            time_scale,
            calibration.model,
            f"{calibration.model} on {calibration.device} ({path})",
        )

    def seconds(self, lengths: Sequence[int]) -> float:
        return sum(self.cost.costs(lengths))
