"""Every touch of FSDP2's private state, in one place.

FSDP2's public hooks (`set_custom_all_gather`, `set_custom_reduce_scatter`, ...) decide *how* bytes move
but not *which* bytes: ODC must publish a rank's all-gather input before any peer asks for it, and must
write gradients back into the sharded `.grad` of each parameter. Both need the per-group parameter
layout that FSDP keeps privately. Reading it here, and only here, keeps a torch upgrade a one-file fix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, TrainingState

# Re-exported: the interfaces of set_custom_all_gather / set_custom_reduce_scatter (public methods whose
# argument types torch keeps in a private module), and FSDP2's own implementations of them.
_ = (AllGather, ReduceScatter, DefaultAllGather, DefaultReduceScatter)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient shard sits inside its group's reduce-scatter output."""

    param: nn.Parameter  # the sharded DTensor parameter
    offset: int  # elements from the start of the group's reduce-scatter output
    padded_numel: int  # elements FSDP reserves for this rank's shard (dim-0 padded)


def fsdp_modules_and_groups(model: nn.Module) -> list[tuple[FSDPModule, list]]:
    """Each FSDP module of `model` (root first) with its parameter groups, after FSDP's lazy init."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules or modules[0] is not model:
        raise ValueError("ODC needs a model whose root module is wrapped with fully_shard")
    # Lazy init fixes the root, the mixed-precision dtypes and the sharded parameters; FSDP runs it on the
    # first forward, but ODC publishes shards before that.
    model._get_fsdp_state()._lazy_init()
    result, seen = [], set()
    for module in modules:
        state = module._get_fsdp_state()
        if id(state) not in seen:
            seen.add(id(state))
            result.append((module, _groups_of(state)))
    return result


def _groups_of(state) -> list:
    if hasattr(state, "_fsdp_param_groups"):  # torch >= 2.12
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group  # torch 2.11: at most one group per module
    return [group] if group is not None else []


def all_gather_input(group) -> torch.Tensor:
    """This rank's all-gather input for `group`, byte for byte what FSDP's copy-in produces."""
    inputs = _fsdp_collectives._get_param_all_gather_inputs(group.fsdp_params)
    flat = [t.reshape(-1) for ts in inputs for t in ts]
    if len({t.dtype for t in flat}) > 1:
        flat = [t.view(torch.uint8) for t in flat]
    return torch.cat(flat)


def grad_slots(group) -> list[ParamSlot]:
    """Every trainable parameter of `group`, in FSDP's order, as its full reduce-scatter layout.

    FSDP reduce-scatters only the parameters that got a gradient on this rank, in this order and each
    padded to `padded_numel`; the ones it left out are gaps in this layout.
    """
    slots, offset = [], 0
    for fsdp_param in group.fsdp_params:
        param = fsdp_param.sharded_param
        if not param.requires_grad:
            continue
        padded = fsdp_param.padded_sharded_param_size.numel()
        slots.append(ParamSlot(param, offset, padded))
        offset += padded
    return slots


def reduce_dtype(group) -> torch.dtype | None:
    """The dtype FSDP reduce-scatters `group`'s gradients in (after lazy init); None where nothing trains."""
    return group._reduce_dtype


def on_compute_stream(group, device: torch.device) -> bool:
    """Whether FSDP is allocating for `group`'s reduce-scatter on the compute stream (its input) rather
    than on the reduce-scatter stream FSDP keeps in the group's comm context (its output). CPU: False."""
    if device.type != "cuda":
        return False
    return torch.cuda.current_stream(device) != group.comm_ctx.reduce_scatter_stream


def at_end_of_backward(callback) -> None:
    """Call `callback` once the backward running now has finished: one of autograd's final callbacks, as
    FSDP2 queues its own post-backward callback (which, queued earlier, runs first)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def reshards_to_a_smaller_group(modules_and_groups: list[tuple[FSDPModule, list]]) -> bool:
    """Whether any group was built with `reshard_after_forward` as an int: after forward its parameters
    are resharded over a smaller group than the one they live on, and backward gathers them from there."""
    return any(
        group.post_forward_mesh_info not in (None, group.mesh_info)
        for _, groups in modules_and_groups
        for group in groups
    )


def reset_to_idle(modules_and_groups: list[tuple[FSDPModule, list]]) -> None:
    """Put every FSDP module (as `fsdp_modules_and_groups` lists them) in the state stock FSDP2 is in
    after a backward.

    A forward that no backward follows leaves modules built with `reshard_after_forward=False` (the root,
    by default) unsharded and its record of forwards (kept for backward prefetching) growing; stock
    FSDP2 clears both in its post-backward callback. Ranks of one ODC mini-batch run different numbers
    of forwards, so without this they would leave it in different states and issue different
    collectives afterwards. Local: no communication.
    """
    for module, groups in modules_and_groups:
        module.reshard()
        for group in groups:
            group._post_forward_indices.clear()
    root = modules_and_groups[0][0]
    root._get_fsdp_state()._comm_ctx.post_forward_order.clear()


def reset_after_failure(modules_and_groups: list[tuple[FSDPModule, list]]) -> None:
    """Return every FSDP module to idle after a forward or backward that raised midway.

    FSDP2's own recovery for that (`reset_iter_state` on the root: in-flight collectives waited for,
    per-iteration trackers and training states cleared, groups resharded; torch 2.11 has none, and gets
    the same steps from `_reset_iter_state`), and what it leaves: the unsharded gradients a backward
    interrupted between autograd's write and FSDP's reduce-scatter, which the next backward would add to.
    """
    root = modules_and_groups[0][0]
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
    else:
        _reset_iter_state(root._get_fsdp_state())
    for _, groups in modules_and_groups:
        for group in groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
    reset_to_idle(modules_and_groups)


def _reset_iter_state(root_state) -> None:
    """torch 2.12's `FSDPState._reset_iter_state` on torch 2.11's state: a forward or backward that raised
    leaves its collectives' events, its groups' unsharded parameters and partial reductions, the modules
    still expected to run forward, and a queued post-backward callback, which the next backward would skip
    queueing, so that its gradients would never be reduced."""
    stream = root_state._device_handle.current_stream()
    comm = root_state._comm_ctx
    for name in ("all_gather_state", "reduce_scatter_state"):
        pending = getattr(comm, name, None)
        if pending is not None and pending.event is not None:
            stream.wait_event(pending.event)
        setattr(comm, name, None)
    comm.post_forward_order.clear()
    for state in root_state._state_ctx.all_states:
        state._modules_to_run_forward.clear()
        state._training_state = TrainingState.IDLE
        for group in _groups_of(state):
            gathered = group._all_gather_result
            if gathered is not None and gathered.all_gather_event is not None:
                stream.wait_event(gathered.all_gather_event)
            if gathered is not None and isinstance(gathered.all_gather_work, torch.distributed.Work):
                gathered.all_gather_work.wait()
            for event in (group._post_reduce_event, getattr(group._all_reduce_state, "event", None)):
                if event is not None:
                    stream.wait_event(event)
            if group._reshard_after_forward_event is not None:
                group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
            group._all_gather_result = group._post_reduce_event = group._all_reduce_state = None
            group._reshard_after_forward_event = group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root_state._state_ctx.iter_forward_root = None
    root_state._state_ctx.post_backward_final_callback_queued = False


def reduce_within_shard_group(modules_and_groups: list[tuple[FSDPModule, list]]) -> None:
    """Make FSDP's HSDP parameter groups reduce only inside their shard group.

    FSDP2 decides to all-reduce a group's gradient shard across replicas after every reduce-scatter
    from the type of its mesh info alone (HSDP), and that all-reduce is a collective inside the
    mini-batch. `set_requires_all_reduce(False)` would skip it, but also skip writing `.grad` and the
    post-accumulate-grad hooks ODC learns the reduced parameters from. So each group gets a plain
    FSDP (shard-only) mesh info over the same mesh and shard dim; the parameters keep their 2-D
    placements, and ODC all-reduces across replicas once per mini-batch itself.
    """
    for _, groups in modules_and_groups:
        for group in groups:
            info = group.mesh_info
            if not isinstance(info, HSDPMeshInfo):
                continue
            shard_only = FSDPMeshInfo(
                **{f.name: getattr(info, f.name) for f in fields(FSDPMeshInfo) if f.init} | {"replicate_mesh_dim": None}
            )
            if hasattr(info, "reduce_scatter_process_group"):  # torch >= 2.12: a group FSDP may build for it
                shard_only.reduce_scatter_process_group = info.reduce_scatter_process_group
            # FSDP compares the two to decide whether resharding after forward moves to another mesh.
            if group.post_forward_mesh_info is info:
                group.post_forward_mesh_info = shard_only
            group.mesh_info = shard_only
