"""What odc-check's measurements mean for a model's training: pure arithmetic, no devices.

A decoder layer's micro-batch runs its forward while the next layer's parameters arrive, and its backward
while they arrive again and its gradients leave, under FSDP and under ODC alike (both prefetch): so a
layer's forward takes max(compute, gather) and its backward max(2 x compute, gather + reduce), with FSDP's
collectives or ODC's gets and accumulates in them. The balanced-load overhead is ODC's layer time over
FSDP's, less 1, with every rank doing the same work (where ODC cannot win anything back); the planner then
says what an imbalanced job wins (odc_plugin.balance), and the verdict weighs the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..balance.costs import FlopsCost, model_config
from ..balance.lengths import RL_PROFILE, rl_math_like
from ..balance.step_time import SCHEMES, SPEEDUP_BASELINE, StepTimeModel, plan_table

# At or below this the verdict says ODC would lose: its transport costs more on balanced work than the
# planner's imbalanced job gains.
LOSES_BELOW = 1.0


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer of a model, as the check needs it."""

    name: str
    params: int
    """Parameters of one decoder layer (every expert of an MoE layer: all are communicated)."""
    layers: int
    attention_flops_per_token_squared: int
    """Per layer: 2 * heads * head_dim, the causal attention's FLOPs per s^2 of a sequence (forward)."""
    flops: FlopsCost

    @classmethod
    def of(cls, model: str) -> LayerShape:
        """From a preset name (balance.costs.PRESETS) or a model directory / config.json."""
        config = model_config(model)
        flops = FlopsCost.from_config(config)
        dense = flops.dense()
        params = (dense.linear_flops_per_token // 2 - dense.hidden_size * dense.vocab_size) // dense.num_hidden_layers
        return cls(
            str(model),
            params,
            dense.num_hidden_layers,
            flops.attention_flops_per_seqlen_squared // flops.num_hidden_layers,
            flops,
        )

    def forward_flops(self, tokens: int) -> float:
        """FLOPs of one layer's forward over one sequence of `tokens` (an MoE's active experts)."""
        active = self.flops.linear_flops_per_token - 2 * self.flops.hidden_size * self.flops.vocab_size
        return active / self.flops.num_hidden_layers * tokens + self.attention_flops_per_token_squared * tokens**2


def layer_seconds(compute_s: float, gather_s: float, reduce_s: float) -> float:
    """A layer's forward and backward of one micro-batch, communication overlapped with compute."""
    return max(compute_s, gather_s) + max(2 * compute_s, gather_s + reduce_s)


def balanced_overhead(compute_s: float, odc: tuple[float, float], fsdp: tuple[float, float]) -> float:
    """ODC's layer time over FSDP's, less 1, for the (gather, reduce) seconds of one layer each."""
    return layer_seconds(compute_s, *odc) / layer_seconds(compute_s, *fsdp) - 1


def planned_speedup(shape: LayerShape, ranks: int, flops_per_s: float, samples_per_rank: int = 8) -> float:
    """The planner's ODC+LB-Mini over FSDP+LB-Micro for an RL job of `shape` on `ranks` ranks: math-reasoning
    response lengths (balance.lengths.rl_math_like at RL_PROFILE), `samples_per_rank` per mini-batch, compute
    at `flops_per_s`, communication hidden (it is what the balanced overhead accounts for)."""
    if ranks < 2:
        return 1.0

    def draw(n: int, seed: int) -> list[int]:
        return rl_math_like(n, **RL_PROFILE, seed=seed).total

    rows = plan_table(
        draw,
        [ranks],
        [samples_per_rank * ranks],
        max_token_len=2 * RL_PROFILE["max_response_length"],
        cost=shape.flops,
        model=StepTimeModel(throughput=flops_per_s),
        draws=1,
    )
    return rows[0].speedup("odc_lb_mini")


@dataclass(frozen=True)
class Verdict:
    transport_ratio: float
    """The collectives' time over ODC's transport's: above 1, ODC's is faster."""
    backend: str
    overhead: float
    """Balanced-load overhead: ODC's layer time over FSDP's, less 1."""
    planned: float | None
    """The planner's ODC+LB-Mini over FSDP+LB-Micro on an imbalanced RL job (None where it could not run)."""

    @property
    def net(self) -> float:
        """What ODC would give: the planner's gain (none where it could not run) over the balanced overhead."""
        return (self.planned or 1.0) / (1 + self.overhead)

    @property
    def loses(self) -> bool:
        return self.net <= LOSES_BELOW

    def line(self) -> str:
        facts = (
            f"ODC's transport is {self.transport_ratio:.2f}x {self.backend}'s collectives here; balanced overhead "
            f"{self.overhead:+.0%}; "
            + (
                f"on an imbalanced RL job the planner predicts {self.planned:.2f}x over "
                f"{SCHEMES[SPEEDUP_BASELINE]}, {self.net:.2f}x with that overhead"
                if self.planned is not None
                else "no prediction for an imbalanced job (the planner needs verl)"
            )
        )
        if self.loses:
            return f"odc-check: WARNING: ODC would lose here: {facts}; keep strategy=fsdp2 on this machine"
        return f"odc-check: {facts}"
