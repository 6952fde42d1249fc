"""The tiny vision-language model's processor: transformers' Qwen2.5-VL processor without its video processor.

transformers builds Qwen2-VL's video processor only with torchvision, and refuses a Qwen2.5-VL processor
without one; PyPI's torchvision wheels for torch 2.13 are built against CUDA's libraries and do not import
beside the CPU build of torch the `cpu` extra installs. Images, which are all the CPU job has, go through
the processor unchanged: its image processor, image tokens and chat template. A video is refused where
transformers' processor would hand it to the video processor.

The tiny model's folder carries this file (transformers' remote code: `auto_map` in its processor_config),
so verl loads it with `actor_rollout_ref.model.trust_remote_code=True`; `AutoProcessor` resolves the class
by its name, which verl's `hf_processor` matches to bind Qwen2.5-VL's multi-axis rope index.
"""

from transformers import Qwen2_5_VLProcessor as _Qwen2_5_VLProcessor


class Qwen2_5_VLProcessor(_Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # the attributes are this signature's: the parent's third positional argument (the video processor) is
        # left out of them
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def _process_videos(self, videos, **kwargs):
        raise ValueError(
            "this processor takes images only: it has no video processor (it is built without torchvision)"
        )
