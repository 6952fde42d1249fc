"""The `odc` engine config: verl's FSDP engine config plus ODC's own options."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from verl.workers.config.engine import EngineConfig, FSDPEngineConfig

from ..comm import TRANSPORTS

BALANCERS = ("lb_mini", "lb_micro")
COST_MODELS = ("tokens", "flops", "fit", "auto")


@dataclass
class ODCEngineConfig(FSDPEngineConfig):
    """Everything `FSDPEngineConfig` has, plus:

    odc_transport: how peers' memory is reached: auto | shm | cuda_ipc | nvshmem.
    odc_balancer: how the trainer spreads each mini-batch over ranks: lb_mini (balance each rank's total
        cost, counts may differ) or lb_micro (verl's equal counts).
    odc_cost_model: the cost of one sequence for lb_mini: tokens | flops (from the model's config) |
        fit (odc_cost_fit_a * s^2 + odc_cost_fit_b * s, from a calibration run) | auto (flops until the
        first update, then c + a*s^2 + b*s per micro-batch and each rank's speed, fitted to the
        micro-batch times measured while training).
    odc_barrier_timeout_s: how long a rank waits for the others at the end of a mini-batch before it
        fails naming the ranks that did not arrive.
    """

    strategy: str = "odc"
    odc_transport: str = "auto"
    odc_balancer: str = "lb_mini"
    odc_cost_model: str = "auto"
    odc_cost_fit_a: float = 0.0
    odc_cost_fit_b: float = 1.0
    odc_barrier_timeout_s: float = 600.0

    def __post_init__(self):
        # FSDPEngineConfig's own check allows only its strategies; everything else it checks is EngineConfig's.
        EngineConfig.__post_init__(self)
        _check_choice("strategy", self.strategy, ("odc",))
        _check_choice("odc_transport", self.odc_transport, TRANSPORTS)
        _check_choice("odc_balancer", self.odc_balancer, BALANCERS)
        _check_choice("odc_cost_model", self.odc_cost_model, COST_MODELS)
        if not self.odc_barrier_timeout_s > 0:
            raise ValueError(f"odc_barrier_timeout_s must be > 0, got {self.odc_barrier_timeout_s}")
        if min(self.odc_cost_fit_a, self.odc_cost_fit_b) < 0 or self.odc_cost_fit_a == self.odc_cost_fit_b == 0:
            raise ValueError(
                f"odc_cost_fit_a and odc_cost_fit_b must be >= 0 and not both 0, got "
                f"{self.odc_cost_fit_a}, {self.odc_cost_fit_b}"
            )


def _check_choice(key: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}, got {value!r}")


def as_odc_config(engine_config: FSDPEngineConfig) -> ODCEngineConfig:
    """The ODC view of an engine config: itself if it is one, else ODC defaults over its FSDP fields.

    verl builds the engine config from its FSDP yaml and only then copies `strategy=odc` onto it, so an
    `odc` engine usually receives a plain FSDPEngineConfig; ODC options then take their defaults.
    """
    if isinstance(engine_config, ODCEngineConfig):
        return engine_config
    shared = {f.name: getattr(engine_config, f.name) for f in fields(FSDPEngineConfig) if f.init}
    shared["strategy"] = "odc"
    return ODCEngineConfig(**shared)
