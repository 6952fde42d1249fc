"""On CPU, the critic's value-head model loads with the attention the config asks for.

verl 0.9.1's `load_valuehead_model` (`verl/utils/model.py`) loads
`AutoModelForTokenClassification` with `attn_implementation="flash_attention_2"` whatever the model
config says, and flash-attention needs a GPU. This patch loads it with the config's attention
(`override_config.attn_implementation`, e.g. sdpa) and otherwise leaves verl's function (its value-head
fallback included) in charge. Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

import inspect

from odc_patches import PatchError, replace_attr

NAME = "cpu_valuehead_attn"
TARGET = "verl.utils.model"


def apply() -> None:
    from verl.utils import model as model_utils

    replace_attr(model_utils, "load_valuehead_model", NAME, _attention_as_configured)


def _attention_as_configured(current):
    params = ["local_path", "torch_dtype", "model_config", "trust_remote_code"]
    if list(inspect.signature(current).parameters) != params:
        raise PatchError(
            f"odc patch '{NAME}': load_valuehead_model{inspect.signature(current)} is not ({', '.join(params)})"
        )
    if "flash_attention_2" not in current.__code__.co_consts:
        raise PatchError(
            f"odc patch '{NAME}': load_valuehead_model no longer forces flash_attention_2; "
            f"re-check whether CPU still needs this patch"
        )

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        attn = getattr(model_config, "_attn_implementation", None)
        if attn in (None, "flash_attention_2"):
            return current(local_path, torch_dtype, model_config, trust_remote_code)
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=attn,
            trust_remote_code=trust_remote_code,
        )

    return load_valuehead_model
