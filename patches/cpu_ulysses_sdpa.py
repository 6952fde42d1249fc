"""On CPU, Ulysses sequence parallelism exchanges attention heads under SDPA attention too.

verl 0.9.1 does Ulysses' all-to-all only in flash attention: `apply_monkey_patch`
(`verl/models/transformers/monkey_patch.py`) swaps transformers' `_flash_attention_forward` for
`_ulysses_flash_attention_forward`, which gathers the sequence and scatters the heads over the group,
attends, and swaps back. Flash attention needs a GPU; on CPU the models run SDPA, which verl leaves
alone, so with `ulysses_sequence_parallel_size` > 1 each rank would attend only within its own slice of
the packed sequences. This patch wraps transformers' `sdpa` attention the same way, with verl's own
all-to-alls (`verl.utils.ulysses.gather_seq_scatter_heads` / `gather_heads_scatter_seq`): the full
packed sequence on 1/N of the heads, a block-causal mask from the gathered position ids (a sequence
starts where its position id is 0, as verl packs them). Outside a Ulysses group it is SDPA unchanged.
Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

import inspect

from odc_patches import PatchError, require_attr

NAME = "cpu_ulysses_sdpa"
TARGET = "verl.models.transformers.monkey_patch"  # imports verl.utils.ulysses first

# verl's Ulysses helpers this patch calls, with the parameters it passes
_USES = {
    "gather_seq_scatter_heads": ["x", "seq_dim", "head_dim", "unpadded_dim_size", "group"],
    "gather_heads_scatter_seq": ["x", "head_dim", "seq_dim", "group"],
    "get_ulysses_sequence_parallel_world_size": ["group"],
    "get_ulysses_sequence_parallel_group": [],
}


def apply() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from verl.models.transformers import monkey_patch
    from verl.utils import ulysses

    for name, params in _USES.items():
        found = list(inspect.signature(require_attr(ulysses, name, NAME)).parameters)
        if found != params:
            raise PatchError(
                f"odc patch '{NAME}': verl.utils.ulysses.{name}({', '.join(found)}) is not ({', '.join(params)})"
            )
    if "sdpa" in inspect.getsource(require_attr(monkey_patch, "apply_monkey_patch", NAME)):
        raise PatchError(
            f"odc patch '{NAME}': verl's apply_monkey_patch now mentions sdpa; re-check whether its "
            f"Ulysses path covers SDPA"
        )
    current = AttentionInterface._global_mapping["sdpa"]
    if getattr(current, "_odc_patched", False):
        return
    if current is not sdpa_attention_forward:
        raise PatchError(f"odc patch '{NAME}': transformers' sdpa attention is already replaced by {current!r}")
    AttentionInterface.register("sdpa", ulysses_sdpa_attention(sdpa_attention_forward, ulysses))


def ulysses_sdpa_attention(sdpa_attention_forward, ulysses):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        group = ulysses.get_ulysses_sequence_parallel_group()
        size = ulysses.get_ulysses_sequence_parallel_world_size(group)
        position_ids = kwargs.get("position_ids")
        if size == 1 or position_ids is None:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        # [batch, heads, seq/N, dim] -> [batch, heads/N, seq, dim]; kv heads repeated to the query's first,
        # so that every rank's share of query heads has its own kv heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        query, key, value = (
            ulysses.gather_seq_scatter_heads(t, seq_dim=2, head_dim=1, group=group) for t in (query, key, value)
        )
        pieces = [torch.empty_like(position_ids) for _ in range(size)]
        dist.all_gather(pieces, position_ids.contiguous(), group=group)
        positions = torch.cat(pieces, dim=-1)  # [batch, seq]
        sequence = (positions == 0).cumsum(-1)
        causal = torch.ones(positions.shape[-1], positions.shape[-1], dtype=torch.bool, device=positions.device).tril()
        mask = (sequence[:, :, None] == sequence[:, None, :]) & causal  # [batch, seq, seq]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask[:, None], scale=scaling, dropout_p=dropout if module.training else 0.0
        )
        # [batch, heads/N, seq, dim] -> [batch, seq/N, heads, dim], as transformers' sdpa returns it
        out = ulysses.gather_heads_scatter_seq(out.transpose(1, 2), head_dim=2, seq_dim=1, group=group)
        return out.contiguous(), None

    attention._odc_patched = True
    attention.__wrapped__ = sdpa_attention_forward
    return attention
