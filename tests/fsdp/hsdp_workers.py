"""Per-rank bodies of the HSDP tests: 4 ranks as 2 simulated nodes x 2 ranks.

The mesh is what `fully_shard` takes for HSDP, (replicate=2, shard=2): ranks 0-1 are one shard group
(node 0), ranks 2-3 the other (node 1), and each rank's replica group pairs it with the rank of the
same shard index on the other node. Each shard group builds its own shared-memory transport, as two
hosts would; nothing but the end-of-mini-batch all-reduce (and the store barrier) crosses between them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import ODCConfig, apply_odc, shard_group
from odc_plugin.models import build_qwen2, shard_qwen2, token_mean_loss

from .workers import _collective_names, count_targets, train_until_victim_dies

MESH_SHAPE = (2, 2)  # (nodes, ranks per node)


def hsdp_model(mixed_precision: bool = False):
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    return shard_qwen2(build_qwen2("tiny", seed=0), mesh, mp)


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().float() for name, p in model.named_parameters()}


class CollectiveCounter:
    """Records every torch.distributed collective called while `counting` is True."""

    def __init__(self):
        self.calls: list[str] = []
        self.counting = False
        self._originals = {name: getattr(dist.distributed_c10d, name) for name in _collective_names()}
        for mod in (dist, dist.distributed_c10d):
            for name, fn in self._originals.items():
                setattr(mod, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            if self.counting:
                self.calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def train(rank, world_size, seqs, plans, use_odc, mixed_precision, count=False):
    """One AdamW step with grad clipping per plan, this rank running the micro-batches plan[rank].

    With `count`, also returns, per step, the collectives called inside the mini-batch (begin() through
    the last backward) and inside end(), and the path of this rank's shared-memory files."""
    model = hsdp_model(mixed_precision)
    odc = None
    if use_odc:
        transport = make_transport("shm", group=shard_group(model))
        odc = apply_odc(model, transport, ODCConfig(barrier_timeout_s=60))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    global_tokens = count_targets(seqs)
    counter = CollectiveCounter() if count else None
    counted = []
    for plan in plans:
        opt.zero_grad(set_to_none=True)
        if counter:
            counter.counting = True
        if odc:
            odc.begin()
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
        if counter:
            inside = counter.take()
        if odc:
            odc.end()
        if counter:
            counted.append({"inside": inside, "end": counter.take()})
            counter.counting = False
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
    params = full_params(model)
    if not count:
        return params
    return params, counted, odc.transport.path_prefix


def stock_and_odc(rank, world_size, seqs, plans):
    """Stock FSDP2 HSDP and ODC on the same mesh and equal counts, fp32 and bf16 params / fp32 reduce."""
    return {
        (mp, use_odc): train(rank, world_size, seqs, plans, use_odc, mp)
        for mp in (False, True)
        for use_odc in (False, True)
    }


def die_mid_minibatch(rank, world_size, seqs, plan, victim, timeout_s):
    model = hsdp_model()
    odc = apply_odc(model, make_transport("shm", group=shard_group(model)), ODCConfig(barrier_timeout_s=timeout_s))
    return train_until_victim_dies(model, odc, rank, world_size, seqs, plan, victim)


def grads_outside_minibatch(rank, world_size, seqs, plan, use_odc):
    """Gradients of one plain backward pass per micro-batch of plan[rank], with no ODC mini-batch around
    them (an evaluation loss, a debugging backward): stock HSDP's, or ODC's collective fallback."""
    model = hsdp_model()
    if use_odc:
        apply_odc(model, make_transport("shm", group=shard_group(model)), ODCConfig(barrier_timeout_s=60))
    global_tokens = count_targets(seqs)
    for mb in plan[rank]:
        token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}


def int_reshard_refused(rank, world_size):
    """apply_odc on a model built with reshard_after_forward=2 (of 4 ranks): the error it raises."""
    from torch.distributed.fsdp import fully_shard

    model = build_qwen2("tiny", seed=0)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    try:
        apply_odc(model, make_transport("shm"))
    except ValueError as e:
        return str(e)
    return "accepted"
