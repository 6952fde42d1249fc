"""A rank's multi-axis rope position ids laid out as verl's engine reads them, whatever share it was sent.

A Qwen2-VL or Qwen2.5-VL sample's position ids are 4 rows (the text's, then time, height and width) over
its tokens, and verl's engine takes a micro-batch's as `position_ids.values()` of shape (4, tokens): a
jagged nested tensor ragged over the tokens. TransferQueue hands a rank its share packed by
`torch.nested.as_nested_tensor`, which makes the samples' lengths the ragged dimension only where they
differ: a share of one sample, or of samples of one length, comes ragged over the 4 rows instead, and
verl's packing then fails (`split_with_sizes expects split_sizes to sum exactly to <tokens> ... got
split_sizes=[4]`) or hands the model 4 rows per sample. LB-Mini's uneven shares make such shares common (a
slow rank may get one sample); an fsdp2 run's equal shares of several samples of different lengths do not
meet them. `lay_out` gives every such tensor verl's own layout.
"""

from __future__ import annotations

import torch


def lay_out(data) -> None:
    """In place: every nested tensor of `data` (a TensorDict) whose samples are matrices, ragged over their
    columns (verl's `nested_tensor_from_tensor_list(..., ragged_idx=2)`)."""
    from verl.utils import tensordict_utils as tu

    for key, value in list(data.items()):
        if isinstance(value, torch.Tensor) and value.is_nested and value.dim() == 3:
            data[key] = tu.nested_tensor_from_tensor_list(samples(value), ragged_idx=2)


def samples(value: torch.Tensor) -> list[torch.Tensor]:
    """Each sample of a 3-D jagged nested tensor, from its values and offsets: ragged over the rows where the
    offsets count the values' rows (`as_nested_tensor` of samples of one length), else over the columns. (Both
    readings hold only for a share of as many tokens as rows, 4, which is one sample of 4 tokens at most: the
    same sample either way.)"""
    values, lengths = value.values(), value.offsets().diff().tolist()
    return list(values.split(lengths, dim=0 if values.shape[0] == sum(lengths) else values.dim() - 1))
