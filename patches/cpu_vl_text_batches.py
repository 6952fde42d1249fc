"""On CPU, a Qwen2-VL or Qwen2.5-VL micro-batch without an image runs, as verl 0.9.1 means it to.

verl 0.9.1's `_get_input_embeds` (`verl/models/transformers/qwen2_vl.py`) passes a blank picture through
the vision tower when a micro-batch has no image, so that every rank runs the tower (FSDP gathers its
weights on all ranks together) and its weights get a gradient of zero, and adds 0 times the output's mean.
Since transformers 5 the tower returns a `BaseModelOutputWithPooling`, which verl unpacks for a real
picture (`unpack_visual_output`) but not for the blank one, so such a micro-batch fails with
`AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'mean'`, under every strategy and on
GPUs too: verl's geo3k data has a picture in every sample, a job that mixes in text-only samples reaches it.
This patch runs that branch with the output unpacked, and verl's own function for every micro-batch with an
image or a video. Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

import inspect

from odc_patches import PatchError, parameters, replace_attr

NAME = "cpu_vl_text_batches"
TARGET = "verl.models.transformers.qwen2_vl"
PARAMETERS = [
    "model",
    "input_ids",
    "attention_mask",
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
]


def apply() -> None:
    from verl.models.transformers import qwen2_vl

    replace_attr(qwen2_vl, "_get_input_embeds", NAME, _blank_picture_unpacked)


def _blank_picture_unpacked(current):
    if parameters(current) != PARAMETERS:
        raise PatchError(f"odc patch '{NAME}': _get_input_embeds' parameters are not ({', '.join(PARAMETERS)})")
    if "0.0 * image_embeds.mean()" not in inspect.getsource(current):
        raise PatchError(
            f"odc patch '{NAME}': _get_input_embeds no longer adds the blank picture's image_embeds.mean(); re-check "
            f"whether CPU still needs this patch"
        )

    def _get_input_embeds(
        model,
        input_ids,
        attention_mask=None,
        pixel_values=None,
        pixel_values_videos=None,
        image_grid_thw=None,
        video_grid_thw=None,
    ):
        import torch
        from verl.utils.transformers_compat import unpack_visual_output

        if pixel_values is not None or pixel_values_videos is not None:
            return current(
                model, input_ids, attention_mask, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw
            )
        inputs_embeds = model.get_input_embeddings()(input_ids)
        # verl's blank picture: 4x4 patches
        config = model.config.vision_config
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        blank = torch.zeros((16, patch_dim), dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        grid = torch.tensor([[1, 4, 4]], dtype=torch.long, device=inputs_embeds.device)
        image_embeds, _ = unpack_visual_output(model.visual(blank, grid_thw=grid))
        inputs_embeds = inputs_embeds + 0.0 * image_embeds.mean()
        return inputs_embeds, attention_mask if attention_mask is None else attention_mask.to(inputs_embeds.device)

    return _get_input_embeds
