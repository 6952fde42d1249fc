"""SPES: MoE pretraining across loosely connected nodes, each node training only its own experts
(arXiv 2602.11543), with centralized data parallelism and full-model averaging as baselines.

A library over a model, not a trainer:

    layout = node_layout(ranks_per_node)                       # the groups inside and across nodes
    prepare_experts(model, config, layout.num_nodes, layout.node)   # split, freeze the others' experts
    ...shard over layout.node_mesh (FSDP2, optionally apply_odc) if a node has several ranks...
    sync = NodeSync(model, layout, config)
    opt = torch.optim.AdamW(trainable_parameters(model))
    for step in range(1, steps + 1):
        loss.backward()
        sync.reduce_gradients(step)    # centralized mode only
        opt.step(); opt.zero_grad()
        sync.maybe_sync(step)          # spes / fedavg: every config.sync_every steps, outer step included
"""

from .config import MODES, SPESConfig
from .experts import (
    MoELayer,
    assign_experts,
    freeze_experts,
    moe_layers,
    prepare_experts,
    split_experts,
    trainable_parameters,
)
from .layout import NodeLayout, node_layout
from .memory import StateBytes, state_bytes
from .merge import merge_alpha, merge_experts
from .sync import CommRecord, NodeSync, SPESSyncError

__all__ = [
    "MODES",
    "CommRecord",
    "MoELayer",
    "NodeLayout",
    "NodeSync",
    "SPESConfig",
    "SPESSyncError",
    "StateBytes",
    "assign_experts",
    "freeze_experts",
    "merge_alpha",
    "merge_experts",
    "moe_layers",
    "node_layout",
    "prepare_experts",
    "split_experts",
    "state_bytes",
    "trainable_parameters",
]
