"""The `odc` engine config: verl's FSDP engine config plus ODC's own options; and how a run's configuration
is read where it may come in any form."""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin

from verl.workers.config.engine import EngineConfig, FSDPEngineConfig

from ..comm import AccumulateChoice, TransportName
from ..comm.base import is_positive_finite

# No `from __future__ import annotations` here: __post_init__ reads the Literal choices off the fields'
# annotations, which must be the types themselves.
Balancer = Literal["lb_mini", "lb_micro"]
CostModelName = Literal["tokens", "flops", "fit", "auto"]
SplitChoice = Literal["off", "auto"]


@dataclass(kw_only=True)
class ODCEngineConfig(FSDPEngineConfig):
    """`FSDPEngineConfig` plus ODC's own options, set per role as `odc_*` keys of its engine config
    (`actor_rollout_ref.actor.fsdp_config.`, `actor_rollout_ref.ref.fsdp_config.`, `critic.fsdp.`)."""

    strategy: Literal["odc"] = "odc"
    """The engine; verl copies it from the role's `strategy`."""

    odc_transport: TransportName = "auto"
    """How a rank reaches its peers' memory: `shm` (CPU ranks of one machine), `cuda_ipc` (GPUs of one
    node), `nvshmem` (GPUs of one node; across nodes ODC runs as HSDP, `fsdp_size` = GPUs per node);
    `auto` picks by device and by where the ranks are."""

    odc_accumulate: AccumulateChoice = "auto"
    """How gradients are added into their owners' accumulators: `direct` (peer atomics on GPUs, locks on CPU),
    `slots` (each sender adds into a slot of its own, the owner folds them at the barrier: no atomics, one
    more copy of the accumulator per peer), or `auto`: the faster of the two as measured when the engine
    starts, `slots` only where its extra memory is under a quarter of the GPU's free memory then (and
    wherever the GPUs' peer atomics fail their start-up check)."""

    odc_balancer: Balancer = "lb_mini"
    """How the trainer spreads each mini-batch over ranks: `lb_mini` balances each rank's total cost (counts
    may differ); `lb_micro` keeps verl's equal counts."""

    odc_cost_model: CostModelName = "auto"
    """The cost of one sequence for `lb_mini`: `tokens`; `flops` (from the model's config, an MoE's active
    parameters); `fit` (`odc_cost_fit_a * s^2 + odc_cost_fit_b * s`, from a calibration run); `auto`
    (`flops` until the first update, then `c + a*s^2 + b*s` per micro-batch and each rank's speed, fitted
    to the micro-batch times measured while training)."""

    odc_cost_fit_a: float = 0.0
    """`fit` cost: the quadratic coefficient (attention), >= 0."""

    odc_cost_fit_b: float = 1.0
    """`fit` cost: the linear coefficient (the weight matrices), >= 0; not both 0."""

    odc_split: SplitChoice = "off"
    """`auto`: LB-Mini's plan may split a mini-batch's longest samples over aligned power-of-two groups of
    ranks (Ulysses sequence parallelism for that micro-batch alone), where that is predicted faster: past
    the longest sample, which LB-Mini alone cannot shorten. Needs `odc_balancer=lb_mini`,
    `ulysses_sequence_parallel_size=1` and `use_remove_padding`; verl's torchrun SFT trainer, and
    main_ppo's updates and forward-only passes (each role's engine its own)."""

    odc_split_bandwidth: float | None = None
    """`odc_split`'s all-to-alls for the planner: bytes per second per GPU and direction (not GB/s: under
    1e6 is refused), as `odc-check` measures them on the job's nodes; None: modelled, ~80% of an H100's
    NVLink 4 (360e9)."""

    odc_split_latency_s: float | None = None
    """`odc_split`'s all-to-alls for the planner: seconds each one takes to start, as `odc-check` measures
    them; None: modelled (20e-6, an H100 node's NCCL)."""

    odc_barrier_timeout_s: float = 600.0
    """How long a rank waits for the others (at the end of a mini-batch, or for a peer's shards) before
    it fails naming the ranks that did not arrive."""

    odc_lockstep: bool = False
    """A baseline, not a speed-up: a barrier before every gather and scatter, so the ranks move layer by
    layer as under FSDP, on ODC's own transport and code, every rank packing as many micro-batches as the
    busiest (verl's same_micro_num_in_dp). Against it, `odc` measures what removing FSDP's lockstep buys
    on one transport (`odc-grpo-cpu --compare fsdp2,lockstep,odc`). Needs `odc_balancer=lb_micro`."""

    def __post_init__(self):
        # FSDPEngineConfig's own check allows only its strategies; everything else it checks is EngineConfig's.
        EngineConfig.__post_init__(self)
        for name, hint in ODCEngineConfig.__annotations__.items():
            if get_origin(hint) is Literal:
                _check_choice(name, getattr(self, name), get_args(hint))
        if self.odc_lockstep and self.odc_balancer != "lb_micro":
            raise ValueError(
                f"odc_lockstep=True runs every rank through the same micro-batch steps, as FSDP does: it needs "
                f"odc_balancer=lb_micro, got {self.odc_balancer!r}"
            )
        if self.odc_split == "auto" and (self.odc_balancer != "lb_mini" or self.ulysses_sequence_parallel_size != 1):
            raise ValueError(
                f"odc_split=auto plans each micro-batch's sequence-parallel group itself: it needs "
                f"odc_balancer=lb_mini and ulysses_sequence_parallel_size=1, got {self.odc_balancer!r} and "
                f"{self.ulysses_sequence_parallel_size}"
            )
        for name in ("odc_split_bandwidth", "odc_split_latency_s"):
            value = getattr(self, name)
            if value is not None and not is_positive_finite(value):
                raise ValueError(f"{name} must be a finite number > 0 (or null: modelled), got {value!r}")
        if self.odc_split_bandwidth is not None and self.odc_split_bandwidth < 1e6:
            raise ValueError(
                f"odc_split_bandwidth is in bytes/s (odc-check prints it, e.g. 3.6e+11 for 360 GB/s), got "
                f"{self.odc_split_bandwidth!r}: under 1 MB/s, a figure in GB/s?"
            )
        if not is_positive_finite(self.odc_barrier_timeout_s):
            raise ValueError(f"odc_barrier_timeout_s must be a finite number > 0, got {self.odc_barrier_timeout_s!r}")
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


def config_value(config, key: str):
    """The value at the dotted `key` of a run's configuration, None where it has none."""
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
        if node is None:
            return None
    return node


def is_vision_language(hf_config) -> bool:
    """A vision-language model (Qwen2-VL, Qwen2.5-VL and the like): its config carries its vision tower's."""
    return hasattr(hf_config, "vision_config")
