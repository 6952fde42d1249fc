"""A model's layers made to take a given time: a slow rank on purpose, or compute emulated from a fit.

A slow rank (a throttled GPU, an older node, a noisy neighbour) is what LB-Mini's rank speeds are for,
and what FSDP's lockstep pays at every layer; `ComputeEmulator(None, F, layers)` makes one on purpose:
each layer sleeps until it has taken F times what it measured, in forward and in backward, between
FSDP's gather and reduce-scatter of that layer (odc-demo --slow-ranks, odc-grpo-cpu --slow-ranks).

With a fit (`EmulationFit`, a GPU cost calibration) the layers instead take the fit's time for the
micro-batch's true lengths, times F. What ODC changes is when ranks wait, not how fast a layer computes;
so a rehearsal at 4 to 32 ranks on a 2-core machine keeps everything real (FSDP2 modules with small real
parameters, collectives, ODC's transport and barriers, the plans, gradients, the optimizer step) except
the layers' arithmetic: every layer computes on short stand-in sequences (each token standing for
`length factor` true tokens), then sleeps until the fit's time for the true lengths has passed, in
forward and in backward, between FSDP's gather and reduce-scatter of that layer. A sleeping rank takes
no core, so 32 ranks can wait at once on 2. `odc-demo --emulate` and `odc-grpo-cpu --emulate` (verl's
trainer, patches/cpu_layer_time.py) both emulate through this module.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from .balance.costs import CostCalibration, FitCost
from .cli_args import number_arg

# "auto" time scale: a rank's fair share of a mini-batch's emulated work takes about this long, which
# keeps what the rehearsal itself costs (processes woken on few cores, Python between layers) small.
AUTO_SHARE_S = 5.0


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
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"--time-scale must be a finite number > 0, got {time_scale}")
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
        """Forward and backward of sequences of these true lengths."""
        return sum(self.cost.costs(lengths))

    def forward_seconds(self, lengths: Sequence[int]) -> float:
        """Forward only (a log-prob or value pass)."""
        return self.seconds(lengths) / (1 + self.backward_ratio)


def auto_time_scale(
    path: str, minibatches: Iterable[Sequence[int]], ranks: int, share_s: float = AUTO_SHARE_S
) -> float:
    """The time scale at which a rank's fair share of the mean mini-batch (true lengths) takes `share_s`."""
    fit = EmulationFit.load(path)
    share = statistics.fmean(fit.seconds(batch) for batch in minibatches) / ranks
    return share_s / share


# argparse type of --time-scale
time_scale_arg = number_arg(float, words=("auto",))


def parse_slow_ranks(spec: str | None, ranks: int) -> dict[int, float]:
    """'R:F[,R:F]' -> {rank: factor}: rank R's layers take F times as long."""
    if not spec:
        return {}
    out: dict[int, float] = {}
    for item in spec.split(","):
        rank, sep, factor = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            r, f = int(rank), float(factor)
        except ValueError:
            raise ValueError(f"--slow-ranks: {item.strip()!r} is not RANK:FACTOR (e.g. 3:1.5)") from None
        if not 0 <= r < ranks:
            raise ValueError(f"--slow-ranks: rank {r} is out of range for {ranks} ranks")
        if not (math.isfinite(f) and f > 0):
            raise ValueError(f"--slow-ranks: factor of rank {r} must be a finite number > 0, got {factor}")
        if r in out:
            raise ValueError(f"--slow-ranks: rank {r} is given twice")
        out[r] = f
    return out


@dataclass
class _LayerClock:
    """One layer call's targets: seconds for forward and backward, None to scale what was measured."""

    forward_s: float | None
    backward_s: float | None
    slowdown: float
    forward_start: float = 0.0
    backward_start: float = 0.0

    def sleep_rest(self, target_s: float | None, start: float) -> None:
        elapsed = time.perf_counter() - start
        rest = (elapsed if target_s is None else target_s) * self.slowdown - elapsed
        if rest > 0:
            time.sleep(rest)


class _ForwardStarts(torch.autograd.Function):
    """On the layer's input: marks where forward starts; its backward, the last of the layer's, waits."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        clock.forward_start = time.perf_counter()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.sleep_rest(ctx.clock.backward_s, ctx.clock.backward_start)
        return grad, None


class _ForwardEnds(torch.autograd.Function):
    """On the layer's output: waits out the forward; its backward, the first of the layer's, marks the
    start (after FSDP's pre-backward gather, which hooks the output)."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        clock.sleep_rest(clock.forward_s, clock.forward_start)
        # A copy, not a view: FSDP hooks the layer's output for its pre-backward gather, and warns on views.
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_start = time.perf_counter()
        return grad, None


class ComputeEmulator:
    """Times the decoder layers it is attached to. With a fit, `micro_batch(true lengths)` before each
    micro-batch's forward sets what each layer takes: the fit's whole-model seconds spread over the
    model's `num_layers` layers, times `slowdown`. Without one, layers take `slowdown` times what they
    measure. One emulator may time several models of the same depth (the demo's rows)."""

    def __init__(self, fit: EmulationFit | None, slowdown: float, num_layers: int):
        if fit is None and slowdown == 1.0:
            raise ValueError("a ComputeEmulator needs a fit, a slowdown, or both")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.fit, self.slowdown, self.num_layers = fit, slowdown, num_layers
        self._layer_s: float | None = None

    def attach(self, layers: Sequence[nn.Module]) -> None:
        """Wrap each layer's forward (inside FSDP's hooks: the gather before, the reduce-scatter after)."""
        if len(layers) != self.num_layers:
            raise ValueError(f"this emulator spreads a model's time over {self.num_layers} layers, got {len(layers)}")
        for layer in layers:
            self._wrap(layer)

    def micro_batch(self, lengths: Sequence[int], share: float = 1.0, extra_s: float = 0.0) -> None:
        """The next micro-batch is of these true lengths; of a sample split over k ranks (Ulysses), a member
        computes `share` = 1/k of it and also spends `extra_s` in the split's all-to-alls."""
        if self.fit is not None:
            self._layer_s = (self.fit.seconds(lengths) * share + extra_s) / self.num_layers

    def _clock(self) -> _LayerClock:
        if self.fit is None:
            return _LayerClock(None, None, self.slowdown)
        if self._layer_s is None:
            raise RuntimeError("ComputeEmulator.micro_batch(lengths) must be called before the forward")
        forward = self._layer_s / (1 + self.fit.backward_ratio)
        return _LayerClock(forward, self._layer_s - forward, self.slowdown)

    def _wrap(self, layer: nn.Module) -> None:
        inner = layer.forward

        def forward(hidden_states, *args, **kwargs):
            clock = self._clock()
            out = inner(_ForwardStarts.apply(hidden_states, clock), *args, **kwargs)
            if isinstance(out, tuple):  # layers that return (hidden_states, ...)
                return (_ForwardEnds.apply(out[0], clock), *out[1:])
            return _ForwardEnds.apply(out, clock)

        layer.forward = forward
