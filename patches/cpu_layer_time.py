"""On CPU, a training rank made slow on purpose: what LB-Mini's rank speeds are for, visible on a laptop.

With `ODC_SLOW_RANKS=R:F[,R:F]` in a worker's environment (`odc-grpo-cpu --slow-ranks`), every FSDP
engine verl builds on training rank R (actor, reference, critic; `fsdp2` and `odc` alike, since `odc`
builds through verl's own method) gets decoder layers that take F times what they measure, forward and
backward (odc_plugin.layer_time). verl 0.9.1 builds the sharded module in
`FSDPEngine._build_fsdp_module(self, module)` (`verl/workers/engine/fsdp/transformer_impl.py:385`);
this patch wraps it. Applied only with VERL_PLATFORM=cpu, and it does nothing without the variable.
"""

from __future__ import annotations

import functools
import inspect
import os

from odc_patches import PatchError, require_attr, require_verl_version
from odc_plugin.verl.cpu import SLOW_RANKS_ENV as ENV

VERL_VERSION = "0.9.1"
NAME = "cpu_slow_rank"
TARGET = "verl.workers.engine.fsdp.transformer_impl"


def decoder_layers(module):
    """The first ModuleList of a model named `layers` (a decoder's blocks, under FSDP too)."""
    import torch.nn as nn

    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(child, nn.ModuleList):
            return child
    raise ValueError(f"{ENV}: found no decoder layers (a ModuleList named 'layers') in {type(module).__name__}")


def apply() -> None:
    require_verl_version(NAME, VERL_VERSION)
    from verl.workers.engine.fsdp import transformer_impl

    engine = require_attr(transformer_impl, "FSDPEngine", NAME)
    build = require_attr(engine, "_build_fsdp_module", NAME)
    if getattr(build, "_odc_patched", False):
        return
    if list(inspect.signature(build).parameters) != ["self", "module"]:
        raise PatchError(
            f"odc patch '{NAME}': FSDPEngine._build_fsdp_module{inspect.signature(build)} is not (self, module)"
        )

    @functools.wraps(build)
    def _build_fsdp_module(self, module):
        module = build(self, module)
        spec = os.environ.get(ENV)
        if spec:
            import torch.distributed as dist

            from odc_plugin.layer_time import ComputeEmulator, parse_slow_ranks

            factor = parse_slow_ranks(spec, dist.get_world_size()).get(dist.get_rank())
            if factor is not None:
                layers = decoder_layers(module)
                ComputeEmulator(None, factor, len(layers)).attach(layers)
        return module

    _build_fsdp_module._odc_patched = True
    engine._build_fsdp_module = _build_fsdp_module
