"""Small Qwen2-architecture causal LMs built from local configs, and FSDP2 applied to them.

Used by the tests, the benchmarks and the demo; nothing is downloaded. Runs whose layer compute is
emulated (odc_plugin.layer_time) use a stand-in instead, whose own compute costs next to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .balance.costs import QWEN2_5_PRESETS
from .fsdp.ulysses import SplitMember, active_split, sequence_parallel_attention


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int


# Sizes chosen so that most parameter dim-0 sizes do not divide by 2, 3 or 4 ranks: FSDP pads those,
# and ODC has to get the padding right.
MODEL_SIZES = {
    "tiny": ModelSize(30, 50, 2, 5, 1, 101),
    "small": ModelSize(128, 344, 4, 4, 2, 1001),
    "base": ModelSize(256, 688, 6, 8, 2, 4001),
    # Not a Qwen2: a stand-in of tiny's shape (build_model), for emulated compute.
    "stand-in": ModelSize(30, 50, 2, 5, 1, 101),
    # Real shapes at random init, for GPU benchmarks.
    **{name: ModelSize(**shape) for name, shape in QWEN2_5_PRESETS.items()},
}


_PACKED_ATTENTION = "odc_packed_causal"


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # inside a split micro-batch (odc_plugin.fsdp.ulysses) it attends over the whole sample from a slice
    AttentionInterface.register(_PACKED_ATTENTION, sequence_parallel_attention(packed_causal_attention))
    # The attention builds its own per-sequence causal structure: no mask needed.
    AttentionMaskInterface.register(_PACKED_ATTENTION, lambda *args, **kwargs: None)


def qwen2_config(size: str | ModelSize = "tiny", tie_word_embeddings: bool = True):
    from transformers import Qwen2Config

    _register_packed_attention()
    if isinstance(size, str):
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size '{size}'; expected one of {', '.join(MODEL_SIZES)}")
        size = MODEL_SIZES[size]
    return Qwen2Config(
        **size.__dict__,
        max_position_embeddings=32768,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=_PACKED_ATTENTION,
        torch_dtype="float32",
    )


def build_qwen2(size: str | ModelSize = "tiny", seed: int = 0, tie_word_embeddings: bool = True) -> nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(size, tie_word_embeddings))
    return model.float()


# A mixture-of-experts layer: 5 experts (a count 2 and 4 ranks do not divide: FSDP pads the stacked experts'
# dim 0), two of them per token.
TINY_MOE = {"moe_intermediate_size": 14, "num_experts": 5, "num_experts_per_tok": 2, "norm_topk_prob": True}


def build_qwen3_moe(seed: int = 0, **overrides) -> nn.Module:
    """A tiny Qwen3-MoE (tiny's shape, every MLP a mixture of experts, in whatever expert layout the
    installed transformers builds), router and experts initialised at random."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _register_packed_attention()
    size = MODEL_SIZES["tiny"]
    config = Qwen3MoeConfig(
        **{**size.__dict__, "head_dim": size.hidden_size // size.num_attention_heads, **TINY_MOE, **overrides},
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attn_implementation=_PACKED_ATTENTION,
        torch_dtype="float32",
        # grouped_mm wants 16-byte strides, which tiny's odd sizes do not have
        experts_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


class _StandInBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, **kwargs):
        if (member := active_split()) is not None:
            # a real layer's attention exchanges tokens among the members: they meet at every layer
            dist.barrier(group=member.group)
        return hidden_states + torch.tanh(self.proj(hidden_states))


class StandInLM(nn.Module):
    """Decoder-shaped (embedding, residual blocks under `model.layers` where fully_shard and the emulator
    look for a decoder's layers, head) and called like the Qwen2 models, but a micro-batch costs it about
    1 ms of CPU instead of 11: with 32 ranks on 2 cores the emulated time, not this, must decide."""

    def __init__(self, size: ModelSize):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(size.vocab_size, size.hidden_size)
        self.model.layers = nn.ModuleList(_StandInBlock(size.hidden_size) for _ in range(size.num_hidden_layers))
        self.lm_head = nn.Linear(size.hidden_size, size.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None):
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden)
        return SimpleNamespace(logits=self.lm_head(hidden))


def build_model(size: str, seed: int = 0) -> nn.Module:
    """The Qwen2 of `size`, or the stand-in."""
    if size != "stand-in":
        return build_qwen2(size, seed)
    torch.manual_seed(seed)
    return StandInLM(MODEL_SIZES[size])


def shard_qwen2(model: nn.Module, mesh: DeviceMesh | None = None, mp_policy: MixedPrecisionPolicy | None = None):
    """fully_shard every decoder layer, then the root (embeddings, final norm and head)."""
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def packed_causal_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None, **kwargs
):
    """Causal attention over sequences packed into one row, each attending only to itself.

    verl trains padding-free: a micro-batch is its sequences concatenated, with position ids restarting
    at every sequence, and varlen flash attention keeps them apart. This is the same on CPU, so that
    compute follows the real tokens (linear in them, quadratic per sequence) as it does on a GPU.
    """
    length = query.shape[2]
    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [length]
    repeat = query.shape[1] // key.shape[1]
    outs = []
    for a, b in zip(starts[:-1], starts[1:]):
        k = key[:, :, a:b].repeat_interleave(repeat, dim=1)
        v = value[:, :, a:b].repeat_interleave(repeat, dim=1)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], k, v, is_causal=True, scale=scaling)
        )
    return torch.cat(outs, dim=2).transpose(1, 2), None


def pack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate 1-D token sequences into one row: (input_ids, position_ids), each (1, total)."""
    input_ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(len(s), device=s.device) for s in seqs])[None]
    return input_ids, position_ids


def next_token_logprobs(model: nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence, log p(token t+1 | tokens <= t) for t = 0 .. len-2, from one packed forward."""
    input_ids, position_ids = pack(seqs)
    logits = model(input_ids=input_ids, position_ids=position_ids).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1)
    bounds = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).tolist()
    # position b-1 predicts the next sequence's first token: drop it
    return [logp[a : b - 1] for a, b in zip(bounds[:-1], bounds[1:])]


def token_mean_loss(model: nn.Module, seqs: list[torch.Tensor], global_tokens: int, world_size: int) -> torch.Tensor:
    """Next-token loss of one micro-batch, normalized as verl does: summed over this micro-batch's
    tokens, divided by the token count of the whole mini-batch (all ranks) and multiplied by the
    data-parallel size, which FSDP's mean over ranks divides out again."""
    return -torch.cat(next_token_logprobs(model, seqs)).sum() / global_tokens * world_size


def split_next_token_logprobs(model: nn.Module, seq: torch.Tensor, member: SplitMember):
    """This member's slice of a sample split over a block of ranks (odc_plugin.fsdp.ulysses): log p(token t+1 |
    tokens <= t) at its positions t, and the positions (those at or past len(seq) - 1 are padding)."""
    start, stop = member.bounds(len(seq))
    padded = torch.nn.functional.pad(seq, (0, stop + 1 - len(seq)))
    positions = torch.arange(start, stop, device=seq.device)
    logits = model(input_ids=padded[None, start:stop], position_ids=positions[None]).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, padded[start + 1 : stop + 1, None]).squeeze(-1)
    return logp, positions


def split_sample_loss(model: nn.Module, seq: torch.Tensor, global_tokens: int, world_size: int, member: SplitMember):
    """token_mean_loss of one sample split over a block of ranks, on this member: the next-token loss of its
    slice; the members' losses sum to the sample's."""
    logp, positions = split_next_token_logprobs(model, seq, member)
    return -logp[positions < len(seq) - 1].sum() / global_tokens * world_size
