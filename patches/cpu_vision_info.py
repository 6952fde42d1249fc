"""On CPU without `qwen_vl_utils`, verl's dataset takes a prompt's images as qwen_vl_utils would give them.

verl 0.9.1's `RLHFDataset._process_multi_modal_info` (`verl/utils/dataset/rl_dataset.py`), which its
agent loop calls for every multimodal prompt, imports `qwen_vl_utils.process_vision_info`, and
qwen_vl_utils imports torchvision, whose PyPI wheels for torch 2.13 are built against CUDA's libraries
and do not import beside torch's CPU build. Where qwen_vl_utils is not installed, this patch gives the
images as its `fetch_image` does (RGB; resized to multiples of two patches, within 4 to 16384 merged
tokens' pixels, or an item's own `min_pixels` / `max_pixels`, by transformers' Qwen2-VL `smart_resize`) and
refuses a video in one line. Applied only with VERL_PLATFORM=cpu; where qwen_vl_utils is installed, verl's
own function runs.
"""

from __future__ import annotations

import importlib.util

from odc_patches import PatchError, parameters, require_attr

NAME = "cpu_vision_info"
TARGET = "verl.utils.dataset.rl_dataset"
# qwen_vl_utils' bounds on an image's size, in merged tokens (IMAGE_MIN_TOKEN_NUM, IMAGE_MAX_TOKEN_NUM)
MIN_TOKENS, MAX_TOKENS = 4, 16384


def apply() -> None:
    from verl.utils.dataset.rl_dataset import RLHFDataset

    if importlib.util.find_spec("qwen_vl_utils") is not None:
        return
    current = require_attr(RLHFDataset, "_process_multi_modal_info", NAME)
    if getattr(current, "_odc_patched", False):
        return
    if parameters(current.__func__) != ["cls", "messages", "image_patch_size", "config"]:
        raise PatchError(f"odc patch '{NAME}': RLHFDataset._process_multi_modal_info's parameters changed")
    if "qwen_vl_utils" not in current.__func__.__code__.co_names:
        raise PatchError(f"odc patch '{NAME}': RLHFDataset._process_multi_modal_info no longer uses qwen_vl_utils")

    def _process_multi_modal_info(cls, messages, image_patch_size, config):
        items = [
            item
            for message in messages
            if isinstance(message.get("content"), list)
            for item in message["content"]
            if isinstance(item, dict) and item.get("type") in ("image", "video")
        ]
        if any(item["type"] == "video" for item in items):
            raise ValueError(
                "odc (VERL_PLATFORM=cpu): a video needs qwen_vl_utils, which is not installed (it needs torchvision)"
            )
        images = [fetch_image(item, image_patch_size) for item in items] or None
        return images, None, cls._extract_audio_info(messages)

    _process_multi_modal_info._odc_patched = True
    _process_multi_modal_info.__wrapped__ = current.__func__
    RLHFDataset._process_multi_modal_info = classmethod(_process_multi_modal_info)


def fetch_image(item: dict, image_patch_size: int):
    """An image item of a message (a PIL image or a path under "image") as qwen_vl_utils.fetch_image gives it."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    image = item["image"]
    image = image if isinstance(image, Image.Image) else Image.open(image)
    if image.mode == "RGBA":  # on white, as qwen_vl_utils' to_rgb
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.split()[3])
        image = white
    image = image.convert("RGB")
    factor = image_patch_size * 2  # Qwen-VL merges 2x2 patches into one token
    height, width = smart_resize(
        image.height,
        image.width,
        factor=factor,
        min_pixels=item.get("min_pixels", MIN_TOKENS * factor**2),
        max_pixels=item.get("max_pixels", MAX_TOKENS * factor**2),
    )
    return image.resize((width, height))
