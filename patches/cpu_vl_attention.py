"""On CPU, Qwen2-VL and Qwen2.5-VL attend with transformers' own attention (SDPA) over packed sequences.

verl 0.9.1's `apply_monkey_patch` (`verl/models/transformers/monkey_patch.py`), with
`use_remove_padding` (verl's default) or Ulysses, replaces `Qwen2VLAttention.forward` and
`Qwen2_5_VLAttention.forward` by `qwen2_vl_attn_forward`, which calls flash attention's varlen kernel
whatever attention the model was loaded with; flash attention needs a GPU. transformers' own forward
attends over verl's packed micro-batch by the model's configured attention: its masks keep each packed
sequence to itself, from the text position ids that start again at 0 for each (the first of verl's 4 rows
of position ids). This patch runs verl's function and then puts transformers' forward back; verl's other
changes to these models (the forward that takes its 4 rows of position ids, the vision tower's run on
every micro-batch) stay. Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

from odc_patches import PatchError, parameters, replace_attr

NAME = "cpu_vl_attention"
TARGET = "verl.models.transformers.monkey_patch"


def apply() -> None:
    from verl.models.transformers import monkey_patch

    replace_attr(monkey_patch, "apply_monkey_patch", NAME, _keep_vl_attention)


def _attention_classes() -> list[type]:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLAttention
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLAttention

    return [Qwen2VLAttention, Qwen2_5_VLAttention]


def _keep_vl_attention(current):
    if parameters(current)[:3] != ["model", "ulysses_sp_size", "use_remove_padding"]:
        raise PatchError(f"odc patch '{NAME}': apply_monkey_patch's parameters changed")
    if "qwen2_vl_attn_forward" not in current.__code__.co_names:
        raise PatchError(
            f"odc patch '{NAME}': apply_monkey_patch no longer sets qwen2_vl_attn_forward; re-check whether CPU "
            f"still needs this patch"
        )

    def apply_monkey_patch(model, *args, **kwargs):
        kept = {cls: cls.forward for cls in _attention_classes()}
        try:
            return current(model, *args, **kwargs)
        finally:
            for cls, forward in kept.items():
                cls.forward = forward

    return apply_monkey_patch
