"""Per-rank bodies of the SPES tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
import os

import torch
from torch.distributed.tensor import DTensor

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import apply_odc
from odc_plugin.spes import MODES, NodeSync, SPESConfig, node_layout, prepare_experts, state_bytes, trainable_parameters
from odc_plugin.spes.experts import local_tensor
from odc_plugin.spes.models import BYTE_VOCAB, build_olmoe, lm_loss, shard_olmoe

SEQ, BATCH = 24, 2


def tokens(step: int, node: int, local_rank: int = 0) -> torch.Tensor:
    """Learnable bytes: each row counts up from a random start by a random stride of 1 to 4."""
    g = torch.Generator().manual_seed(1000 * step + 10 * node + local_rank)
    start = torch.randint(0, BYTE_VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % BYTE_VOCAB


def build(layout, config: SPESConfig, inner: str = "none", num_experts: int | None = None):
    """The test-size OLMoE of one rank: experts split and owned, sharded inside the node, synced across."""
    model = build_olmoe("test", seed=0, num_experts=num_experts)
    prepare_experts(model, config, layout.num_nodes, layout.node)
    odc = None
    if inner != "none":
        shard_olmoe(model, layout.node_mesh)
        if inner == "odc":
            odc = apply_odc(model, make_transport("shm", group=layout.node_group))
    return model, odc, NodeSync(model, layout, config)


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered inside the node when sharded)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def train_and_sync(rank, world, ranks_per_node: int, inner: str, config: SPESConfig, steps: int):
    """AdamW steps with a sync every `config.sync_every`; before each sync every rank perturbs the expert
    copies its node does not own, which no node may then see, and runs an evaluation forward (after
    which an FSDP root keeps its parameters gathered). Returns, per sync, the whole model just before
    and just after it (local rank 0 of each node), and what frozen experts held."""
    layout = node_layout(ranks_per_node, config.sync_timeout_s)
    model, odc, sync = build(layout, config, inner)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    out = {
        "node": layout.node,
        "losses": [],
        "syncs": [],
        "frozen_grads": 0,
        "owned": sync.owned,
        "trainable": sum(local_tensor(p).numel() for p in trainable_parameters(model)),
    }
    g = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        with odc.minibatch() if odc else contextlib.nullcontext():
            loss = lm_loss(model, tokens(step, layout.node, layout.local_rank))
            loss.backward()
        out["losses"].append(loss.item())
        out["frozen_grads"] += sum(p.grad is not None for p in frozen)
        opt.step()
        if step == 1:
            out["state"] = state_bytes(model, opt, sync.outer)
        opt.zero_grad(set_to_none=True)
        if step % config.sync_every == 0:
            with torch.no_grad():
                for p in frozen:
                    local = local_tensor(p)
                    local.add_(torch.randn(local.shape, generator=g))
            before = full_state(model)
            with torch.no_grad():
                lm_loss(model, tokens(0, layout.node, layout.local_rank), aux=False)
            record = sync.maybe_sync(step)
            after = full_state(model)
            out["syncs"].append(
                {"record": record, **({"before": before, "after": after} if layout.local_rank == 0 else {})}
            )
    out["frozen_opt_state"] = sum(p in opt.state for p in frozen)
    out["opt_state_params"] = len(opt.state)
    return out


def train_and_sync_each(rank, world, ranks_per_node: int, inners: tuple[str, ...], config: SPESConfig, steps: int):
    """`train_and_sync` once per in-node sharding, in the same processes."""
    return {inner: train_and_sync(rank, world, ranks_per_node, inner, config, steps) for inner in inners}


def train_and_sync_configs(rank, world, configs: list[SPESConfig], steps: int):
    """`train_and_sync` once per config, one rank per node, in the same processes."""
    return [train_and_sync(rank, world, 1, "none", config, steps) for config in configs]


def sgd_every_mode(rank, world, steps: int, lr: float):
    """SGD with momentum, H = 1, no merging and no outer step, one rank per node, in each mode; the
    parameters after every step. Every trainable parameter starts with a zero gradient, so that a step
    where no token reaches an expert still moves it by its momentum, as data parallelism does."""
    layout = node_layout(1)
    result = {}
    for mode in MODES:
        config = SPESConfig(mode=mode, sync_every=1, outer_optimizer="none", merge_alpha_start=0.0)
        model, _, sync = build(layout, config)
        params = trainable_parameters(model)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
        snapshots = []
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=False)
            lm_loss(model, tokens(step, layout.node)).backward()
            sync.reduce_gradients(step)
            opt.step()
            sync.maybe_sync(step)
            snapshots.append(full_state(model))
        result[mode] = snapshots
    return result


def die_mid_sync(rank, world, dying_node: int, timeout_s: float):
    """One step, then a sync during which `dying_node` exits after the shared-parameter average."""
    layout = node_layout(1, timeout_s)
    config = SPESConfig(sync_every=1, merge_alpha_start=0.0, sync_timeout_s=timeout_s)
    model, _, sync = build(layout, config, num_experts=2 * world)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    lm_loss(model, tokens(1, layout.node)).backward()
    opt.step()
    if layout.node == dying_node:
        sync.average_shared()
        os._exit(17)
    sync.maybe_sync(1)
    return "sync completed"
