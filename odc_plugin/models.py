"""Small Qwen2-architecture causal LMs built from local configs, and FSDP2 applied to them.

Used by the tests, the benchmarks and the demo; nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


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
}


def qwen2_config(size: str | ModelSize = "tiny", tie_word_embeddings: bool = True):
    from transformers import Qwen2Config

    if isinstance(size, str):
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size '{size}'; expected one of {', '.join(MODEL_SIZES)}")
        size = MODEL_SIZES[size]
    return Qwen2Config(
        **size.__dict__,
        max_position_embeddings=32768,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="sdpa",
        torch_dtype="float32",
    )


def build_qwen2(size: str | ModelSize = "tiny", seed: int = 0, tie_word_embeddings: bool = True) -> nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(size, tie_word_embeddings))
    return model.float()


def shard_qwen2(model: nn.Module, mesh: DeviceMesh | None = None, mp_policy: MixedPrecisionPolicy | None = None):
    """fully_shard every decoder layer, then the root (embeddings, final norm and head)."""
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def pad_batch(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D token sequences into (input_ids, attention_mask)."""
    longest = max(len(s) for s in seqs)
    input_ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return input_ids, mask


def next_token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position, shape (batch, length - 1); padding gives junk."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def token_mean_loss(model: nn.Module, seqs: list[torch.Tensor], global_tokens: int, world_size: int) -> torch.Tensor:
    """Next-token loss of one micro-batch, normalized as verl does: summed over this micro-batch's
    tokens, divided by the token count of the whole mini-batch (all ranks) and multiplied by the
    data-parallel size, which FSDP's mean over ranks divides out again."""
    ids, mask = pad_batch(seqs)
    logp = next_token_logprobs(model, ids, mask)
    return -(logp * mask[:, 1:]).sum() / global_tokens * world_size
