"""Per-rank bodies of the tests of ODC's memory and of its accumulator as `.grad` storage."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import ODCConfig, apply_odc
from odc_plugin.models import build_qwen2, shard_qwen2, token_mean_loss

from . import failure_workers
from .workers import count_targets, full_grads, full_params, minibatch_backward, sharded_model

BF16_MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def memory(rank, world_size):
    """memory_bytes() of the tiny model trained and forward-only, under bf16 mixed precision and in fp32,
    and of a model whose parameters are bf16; whether the forward-only ones hold a gradient region."""
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for label, dtype, mp, trains in (
        ("bf16 mixed precision, trained", torch.float32, BF16_MP, True),
        ("bf16 mixed precision, forward-only", torch.float32, BF16_MP, False),
        ("fp32, trained", torch.float32, None, True),
        ("fp32, forward-only", torch.float32, None, False),
        ("bf16 parameters, trained", torch.bfloat16, None, True),
    ):
        model = shard_qwen2(build_qwen2("tiny", seed=0).to(dtype), mesh, mp)
        odc = apply_odc(model, make_transport("shm"), ODCConfig(trains=trains))
        out[label] = {"memory": odc.memory_bytes(), "grads_region": odc.grads is not None}
        if not trains:
            try:
                odc.begin()
            except ValueError as e:
                out[label]["backward_refused"] = str(e)
        odc.close()
    return out


def _accumulator_of(odc):
    acc = odc.grads.local
    return acc.data_ptr(), acc.data_ptr() + acc.numel() * acc.element_size()


def _storage_in(grad, span) -> bool:
    ptr = grad.to_local().data_ptr()
    return span[0] <= ptr < span[1]


def accumulate_over_minibatches(rank, world_size, seqs, plans, failed_plan):
    """One AdamW step over several mini-batches without zeroing in between (plans[0] after
    zero_grad(set_to_none=True), plans[1] after a zero_grad(set_to_none=False) of nothing, then the rest),
    then a failed mini-batch and the same again. Returns what `.grad` was during a mini-batch and after
    it, after the failure, and the trained parameters."""
    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    span = _accumulator_of(odc)
    global_tokens = count_targets(seqs)
    seen = {}

    def minibatch(plan):
        with odc.minibatch():
            for mb in plan[rank]:
                token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            # FSDP's adds went into zeros that are not the accumulator, and kept no buffer of its own
            seen["inside: zero"] = all(not g.to_local().any() for g in grads)
            seen["inside: in the accumulator"] = any(_storage_in(g, span) for g in grads)
            seen["inside: storages"] = len({g.to_local().untyped_storage().data_ptr() for g in grads})

    def accumulated_step():
        opt.zero_grad(set_to_none=True)
        minibatch(plans[0])
        opt.zero_grad(set_to_none=False)  # zeroes the accumulator through the views
        for plan in plans:
            minibatch(plan)
        seen["after: views of the accumulator"] = all(
            _storage_in(p.grad, span) for p in model.parameters() if p.grad is not None
        )
        seen.setdefault("accumulated grads", full_grads(model))
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()

    accumulated_step()
    minibatch(plans[0])  # accumulated into the last step's gradients, then lost with the failure
    seen["failed"] = failure_workers.failing_minibatch(
        model, odc, rank, world_size, seqs, failed_plan, 1, "after_first_backward"
    )[0]
    seen["grads after the failure"] = [n for n, p in model.named_parameters() if p.grad is not None]
    accumulated_step()
    seen["params"] = full_params(model)
    odc.close()
    return seen


def bf16_params_grads(rank, world_size, seqs, plan, use_odc):
    """Gradients of one mini-batch of a model whose parameters are bf16, reduced in fp32."""
    mesh, mp = init_device_mesh("cpu", (world_size,)), MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model = shard_qwen2(build_qwen2("tiny", seed=0).to(torch.bfloat16), mesh, mp)
    odc = apply_odc(model, make_transport("shm")) if use_odc else None
    minibatch_backward(model, odc, rank, world_size, seqs, plan, count_targets(seqs))
    dtypes = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    return full_grads(model), dtypes


def offloaded_adamw_steps(rank, world_size, seqs, plan, steps):
    """workers.train_steps with FSDP2's CPU offload (offload_policy): on CPU the accumulator, and so the
    gradients, are on the parameters' device."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from .workers import adamw_steps

    model, mesh = build_qwen2("tiny", seed=0), init_device_mesh("cpu", (world_size,))
    for module in [*model.model.layers, model]:
        fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    odc = apply_odc(model, make_transport("shm"))
    return adamw_steps(model, odc, rank, world_size, seqs, plan, steps)
