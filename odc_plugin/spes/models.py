"""Tiny OLMoE language models (transformers' own MoE classes), built from local configs, byte-level."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

BYTE_VOCAB = 256


@dataclass(frozen=True)
class MoESize:
    hidden_size: int
    intermediate_size: int  # per expert
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int


# Experts hold most of the weights, as in real MoE models: that is where SPES saves.
MOE_SIZES = {
    "test": MoESize(32, 32, 2, 2, 4, 2),
    "tiny": MoESize(64, 128, 2, 4, 8, 2),
}


def build_olmoe(size: str | MoESize = "tiny", seed: int = 0, num_experts: int | None = None) -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    if isinstance(size, str):
        if size not in MOE_SIZES:
            raise ValueError(f"unknown MoE size '{size}'; expected one of {', '.join(MOE_SIZES)}")
        size = MOE_SIZES[size]
    fields = dict(size.__dict__, num_experts=num_experts or size.num_experts)
    config = OlmoeConfig(
        **fields,
        vocab_size=BYTE_VOCAB,
        num_key_value_heads=size.num_attention_heads,
        max_position_embeddings=4096,
        pad_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
        experts_implementation="eager",
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(seed)
    return OlmoeForCausalLM(config).float()


def lm_loss(model: nn.Module, tokens: torch.Tensor, aux: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy over a (batch, length) block, plus the router's load-balancing
    loss (OLMoE's coefficient) when `aux`."""
    out = model(input_ids=tokens, output_router_logits=aux)
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    return loss + model.config.router_aux_loss_coef * out.aux_loss if aux else loss


def shard_olmoe(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """fully_shard every decoder layer, then the root (embeddings, final norm, head)."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
