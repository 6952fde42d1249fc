"""On CPU, training ranks' layers made to take a given time: a slow rank on purpose, or a GPU's compute
emulated at many ranks on a laptop (odc_plugin.layer_time, the one emulation module odc-demo uses too).

Every FSDP engine verl builds on a training rank (actor, reference, critic; `fsdp2` and `odc` alike,
since `odc` builds through verl's own method) gets decoder layers timed by a `ComputeEmulator`:

- with `ODC_SLOW_RANKS=R:F[,R:F]` (`odc-grpo-cpu --slow-ranks`) rank R's layers take F times what they
  measure, or F times the emulated time;
- with `ODC_EMULATION` naming a run's Emulation (odc_plugin/verl/cpu/emulation.py, `odc-grpo-cpu
  --emulate`) each layer takes the GPU fit's time for its micro-batch's true lengths (the engine's
  sequence lengths times the length factor, set before each micro-batch's forward); a micro-batch under a
  Ulysses group of k (verl's own, or a split sample's under odc_split) a k-th of it, plus the modelled
  all-to-alls of the fit's model (odc_plugin.balance.split.UlyssesModel); and each rank records
  every mini-batch it runs (phase, micro-batches) for the planner's prediction and the idle time.

verl 0.9.1 builds the sharded module in `FSDPEngine._build_fsdp_module(self, module)`
(`verl/workers/engine/fsdp/transformer_impl.py`); this patch wraps it. Applied only with
VERL_PLATFORM=cpu, and it does nothing without either variable.
"""

from __future__ import annotations

import inspect
import os
import time

from odc_patches import PatchError, replace_attr, require_attr
from odc_plugin.verl.cpu import SLOW_RANKS_ENV

NAME = "cpu_layer_time"
TARGET = "verl.workers.engine.fsdp.transformer_impl"


def decoder_layers(module):
    """The first ModuleList of a model named `layers` (a decoder's blocks, under FSDP too)."""
    import torch.nn as nn

    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(child, nn.ModuleList):
            return child
    raise ValueError(
        f"{NAME}: found no decoder layers (a ModuleList named 'layers') in {type(module).__name__} to time"
    )


def phase_of(engine, data, forward_only: bool) -> str:
    """verl's name (timing_s/<phase>) of the pass an engine runs on `data`."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    if isinstance(engine, FSDPEngineWithValueHead):
        return "values" if forward_only else "update_critic"
    if engine.engine_config.forward_only:
        return "ref"
    if forward_only:  # the actor's engine; with the reference model inside it (LoRA), verl marks that pass
        return "ref" if tu.get_non_tensor_data(data, key="no_lora_adapter", default=False) else "old_log_prob"
    return "update_actor"


def _time_engine(engine, emulator, emulation) -> None:
    """Set each micro-batch's true lengths before its forward and, with a passes directory, record every
    mini-batch; both on the engine instance, whose forward_backward_batch (verl's or odc's) calls them."""
    import torch.distributed as dist

    from odc_plugin.balance.split import UlyssesModel
    from odc_plugin.verl.cpu.emulation import record_pass

    forward_step, forward_backward_batch = engine.forward_step, engine.forward_backward_batch
    ran: list[list[int]] = []
    fit = emulation.layer_fit()
    all_to_alls = UlyssesModel.from_config(fit.model)

    def timed_forward_step(micro_batch, loss_function, forward_only):
        lengths = micro_batch["input_ids"].offsets().diff().tolist()  # verl's no-padding layout, as verl reads it
        true = emulation.true_lengths(lengths)
        k = engine.ulysses_sequence_parallel_size  # read now: a split micro-batch's group under odc_split
        emulator.micro_batch(true, 1 / k, all_to_alls.seconds(sum(true), k) * fit.time_scale)
        ran.append(lengths)
        return forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)

    def recorded_forward_backward_batch(data, loss_function, forward_only=False):
        ran.clear()
        start = time.perf_counter()
        out = forward_backward_batch(data, loss_function, forward_only=forward_only)
        if emulation.passes_dir:
            phase = phase_of(engine, data, forward_only)
            record_pass(emulation.passes_dir, dist.get_rank(), phase, list(ran), time.perf_counter() - start)
        return out

    engine.forward_step = timed_forward_step
    engine.forward_backward_batch = recorded_forward_backward_batch


def apply() -> None:
    from verl.workers.engine.fsdp import transformer_impl

    engine = require_attr(transformer_impl, "FSDPEngine", NAME)

    def timed_layers(build):
        _check_engine(engine, build)
        return _timed_layers(build)

    replace_attr(engine, "_build_fsdp_module", NAME, timed_layers)


def _check_engine(engine, build) -> None:
    if list(inspect.signature(build).parameters) != ["self", "module"]:
        raise PatchError(
            f"odc patch '{NAME}': FSDPEngine._build_fsdp_module{inspect.signature(build)} is not (self, module)"
        )
    for method, params in (
        ("forward_step", ["self", "micro_batch", "loss_function", "forward_only"]),
        ("forward_backward_batch", ["self", "data", "loss_function", "forward_only"]),
    ):
        found = list(inspect.signature(require_attr(engine, method, NAME)).parameters)
        if found != params:
            raise PatchError(
                f"odc patch '{NAME}': FSDPEngine.{method}({', '.join(found)}) is not ({', '.join(params)})"
            )


def _timed_layers(build):
    def _build_fsdp_module(self, module):
        module = build(self, module)
        from odc_plugin.verl.cpu.emulation import Emulation

        emulation = Emulation.from_env()
        fit = emulation.layer_fit() if emulation else None
        spec = os.environ.get(SLOW_RANKS_ENV)
        if fit is None and not spec:
            return module
        import torch.distributed as dist

        from odc_plugin.layer_time import ComputeEmulator, parse_slow_ranks

        factor = parse_slow_ranks(spec, dist.get_world_size()).get(dist.get_rank(), 1.0)
        if fit is None and factor == 1.0:
            return module
        layers = decoder_layers(module)
        emulator = ComputeEmulator(fit, factor, len(layers))
        emulator.attach(layers)
        if fit is not None:
            _time_engine(self, emulator, emulation)
        return module

    return _build_fsdp_module
