"""The CPU patches (patches/cpu_*.py, hf_rollout_registry), applied only with VERL_PLATFORM=cpu
(tests/verl/test_cpu_mode.py checks the switch): each applies to stock verl once, refuses (PatchError) a verl
that changed under it, and on another verl version applies after one warning per process, since CPU mode
serves fsdp2 runs too. `replace_attr`, the helper of the patches that replace an attribute of verl's."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import pkgutil
import types

import pytest
import torch

import odc_patches
from odc_patches import (
    CPU_PATCHES,
    PatchError,
    cpu_layer_time,
    cpu_offload_unpinned,
    cpu_process_group,
    cpu_sharded_save,
    cpu_ulysses_sdpa,
    cpu_valuehead_attn,
    cpu_vision_info,
    cpu_vl_attention,
    cpu_vl_text_batches,
    hf_rollout_registry,
)

from . import harness

# patch -> (module, attribute it replaces)
CPU_REPLACED = {
    "cpu_process_group": ("verl.workers.engine_workers", "initialize_global_process_group_ray"),
    "cpu_offload_unpinned": ("verl.workers.engine.fsdp.transformer_impl", "CPUOffloadPolicy"),
    "cpu_valuehead_attn": ("verl.utils.model", "load_valuehead_model"),
    "cpu_sharded_save": ("verl.utils.fsdp_utils", "fsdp2_sharded_save_to_cpu"),
    "cpu_vl_attention": ("verl.models.transformers.monkey_patch", "apply_monkey_patch"),
    "cpu_vl_text_batches": ("verl.models.transformers.qwen2_vl", "_get_input_embeds"),
}


def _unpatched(fn):
    return fn.__wrapped__ if getattr(fn, "_odc_patched", False) else fn


@pytest.fixture
def stock_cpu(monkeypatch):
    """verl without the CPU patches; whatever a test changes is put back."""
    from verl.utils import distributed
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    from verl.workers.rollout import base

    for module, attr in CPU_REPLACED.values():
        owner = importlib.import_module(module)
        monkeypatch.setattr(owner, attr, _unpatched(getattr(owner, attr)))
    monkeypatch.setattr(
        distributed, "initialize_global_process_group", _unpatched(distributed.initialize_global_process_group)
    )
    from verl.utils.dataset.rl_dataset import RLHFDataset

    vision_info = RLHFDataset.__dict__["_process_multi_modal_info"].__func__  # a classmethod
    monkeypatch.setattr(RLHFDataset, "_process_multi_modal_info", classmethod(_unpatched(vision_info)))
    registry = dict(base._ROLLOUT_REGISTRY)
    registry.pop(("hf", "async"), None)
    monkeypatch.setattr(base, "_ROLLOUT_REGISTRY", registry)
    monkeypatch.setattr(FSDPEngine, "_build_fsdp_module", _unpatched(FSDPEngine._build_fsdp_module))
    from transformers import AttentionInterface

    sdpa = AttentionInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", getattr(sdpa, "__wrapped__", sdpa))
    return monkeypatch


def test_cpu_patch_list():
    assert CPU_PATCHES == (
        "cpu_process_group",
        "cpu_offload_unpinned",
        "cpu_valuehead_attn",
        "hf_rollout_registry",
        "cpu_layer_time",
        "cpu_ulysses_sdpa",
        "cpu_vl_attention",
        "cpu_vl_text_batches",
        "cpu_batch_order",
        "cpu_replay_poll",
        "cpu_sharded_save",
        "cpu_vision_info",
    )
    for name in CPU_PATCHES:
        patch = importlib.import_module(f"odc_patches.{name}")
        assert importlib.util.find_spec(patch.TARGET) is not None, patch.TARGET
        assert callable(patch.apply) and not hasattr(patch, "VERL_VERSION")  # one version: PATCHED_VERL_VERSION
    for name, (module, _) in CPU_REPLACED.items():
        assert getattr(odc_patches, name).TARGET == module


def test_cpu_patches_apply_to_stock_verl(stock_cpu, tmp_path):
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.rollout.base import get_rollout_class

    from odc_plugin.verl.cpu.rollout import HFServerAdapter

    assert odc_patches.apply_all(CPU_PATCHES) == list(CPU_PATCHES)
    replaced = {name: getattr(importlib.import_module(m), a) for name, (m, a) in CPU_REPLACED.items()}
    assert all(getattr(fn, "_odc_patched", False) for fn in replaced.values())
    policy = replaced["cpu_offload_unpinned"](pin_memory=True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    assert get_rollout_class("hf", "async") is HFServerAdapter
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    assert FSDPEngine._build_fsdp_module._odc_patched
    from transformers import AttentionInterface

    assert AttentionInterface._global_mapping["sdpa"]._odc_patched  # Ulysses' head exchange under SDPA
    # the critic's value-head model loads with the attention its config names (stock verl forces
    # flash_attention_2, which is not installed here)
    from transformers import AutoConfig

    model_dir = harness.make_tiny_qwen2(str(tmp_path))
    config = AutoConfig.from_pretrained(model_dir, attn_implementation="sdpa", num_labels=1)
    model = replaced["cpu_valuehead_attn"](model_dir, torch_dtype=None, model_config=config, trust_remote_code=False)
    assert type(model).__name__ == "Qwen2ForTokenClassification" and model.config._attn_implementation == "sdpa"
    # verl's dataset takes images without qwen_vl_utils (not installed here: it needs torchvision)
    from verl.utils.dataset.rl_dataset import RLHFDataset

    assert importlib.util.find_spec("qwen_vl_utils") is None and RLHFDataset._process_multi_modal_info._odc_patched
    # applying again changes nothing
    odc_patches.apply_all(CPU_PATCHES)
    assert replaced == {name: getattr(importlib.import_module(m), a) for name, (m, a) in CPU_REPLACED.items()}


def test_cpu_patches_apply_on_another_verl_version_after_one_warning(stock_cpu, other_verl, caplog):
    """CPU mode serves fsdp2 runs too, which another verl version must not fail: its patches apply where their
    own checks of verl pass, after one warning per process; odc runs are refused (one check, once)."""
    with caplog.at_level(logging.WARNING, logger="odc_patches"):
        assert odc_patches.apply_all(CPU_PATCHES) == list(CPU_PATCHES)
        odc_patches.apply_all(CPU_PATCHES)
    assert [r.getMessage() for r in caplog.records] == [
        "odc's CPU patches target verl 0.9.1, but verl 0.9.2 is installed; they apply where their checks of verl "
        "pass (VERL_PLATFORM=cpu)"
    ]
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    assert FSDPEngine._build_fsdp_module._odc_patched
    with pytest.raises(PatchError, match="^strategy=odc needs verl 0.9.1, .* but verl 0.9.2 is installed; "):
        odc_patches.require_odc_verl()


def _value_head_fixed_upstream(local_path, torch_dtype, model_config, trust_remote_code):
    return None


# (patch, the owner of what it replaces or reads (pkgutil.resolve_name), its attribute, verl's changed version of
# it, what the refusal says)
CHANGED_TARGETS = [
    (
        cpu_process_group,
        "verl.workers.engine_workers",
        "initialize_global_process_group_ray",
        lambda timeout_second=None: None,
        "is not verl.utils.distributed's any more",
    ),
    (
        cpu_offload_unpinned,
        "verl.workers.engine.fsdp.transformer_impl",
        "CPUOffloadPolicy",
        object,
        "CPUOffloadPolicy is not torch's any more",
    ),
    (
        cpu_valuehead_attn,
        "verl.utils.model",
        "load_valuehead_model",
        _value_head_fixed_upstream,
        "no longer forces flash_attention_2",
    ),
    (hf_rollout_registry, "verl.workers.rollout.base", "_ROLLOUT_REGISTRY", {}, "no longer a dict keyed by"),
    (
        cpu_vl_attention,
        "verl.models.transformers.monkey_patch",
        "apply_monkey_patch",
        lambda model, ulysses_sp_size=1, use_remove_padding=True: None,  # the flash attention patch is gone
        "apply_monkey_patch no longer sets qwen2_vl_attn_forward",
    ),
    (
        cpu_vl_text_batches,
        "verl.models.transformers.qwen2_vl",
        "_get_input_embeds",
        lambda model, input_ids, attention_mask, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw: (
            None
        ),  # unpacks the blank picture's output itself now
        "no longer adds the blank picture's image_embeds.mean",
    ),
    (
        cpu_vision_info,
        "verl.utils.dataset.rl_dataset:RLHFDataset",
        "_process_multi_modal_info",
        classmethod(lambda cls, messages, image_patch_size, config: (None, None, None)),
        "no longer uses qwen_vl_utils",
    ),
    (
        cpu_layer_time,
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngine",
        "_build_fsdp_module",
        lambda self, module, mesh: module,
        r"_build_fsdp_module\(self, module, mesh\) is not \(self, module\)",
    ),
    (
        cpu_ulysses_sdpa,
        "verl.utils.ulysses",
        "gather_seq_scatter_heads",
        lambda x, seq_dim, head_dim, group=None: x,
        r"gather_seq_scatter_heads\(x, seq_dim, head_dim, group\) is not",
    ),
    (
        cpu_sharded_save,
        "verl.utils.fsdp_utils",
        "fsdp2_sharded_save_to_cpu",
        lambda model: ({}, None),  # copies on CPU too now
        r"fsdp2_sharded_save_to_cpu no longer takes the local shards .cpu\(\)",
    ),
]


@pytest.mark.parametrize("patch,owner,attr,changed,refusal", CHANGED_TARGETS, ids=[c[0].NAME for c in CHANGED_TARGETS])
def test_a_cpu_patch_refuses_a_changed_target_and_changes_nothing(stock_cpu, patch, owner, attr, changed, refusal):
    target = pkgutil.resolve_name(owner)
    stock_cpu.setattr(target, attr, changed)
    with pytest.raises(PatchError, match=refusal):
        patch.apply()
    assert inspect.getattr_static(target, attr) is changed  # a classmethod itself, not bound to its class


def test_replace_attr_replaces_once_with_the_replaced_ones_name_and_attributes():
    def verls(x):
        """verl's docstring"""
        return x

    verls.dispatch_mode = "ONE_TO_ALL"  # what verl's register puts on a method
    owner = types.ModuleType("verls_module")
    owner.fn, owner.cls = verls, int
    made = []

    def doubled(current):
        made.append(current)

        def fn(x):
            return 2 * current(x)

        return fn

    odc_patches.replace_attr(owner, "fn", "test", doubled)
    odc_patches.replace_attr(owner, "fn", "test", doubled)  # replaced already: nothing made, nothing changed
    assert made == [verls] and owner.fn(3) == 6 and owner.fn._odc_patched
    assert owner.fn.__wrapped__ is verls and owner.fn.__name__ == "verls" and owner.fn.__doc__ == "verl's docstring"
    assert owner.fn.dispatch_mode == "ONE_TO_ALL"
    odc_patches.replace_attr(owner, "cls", "test", lambda current: lambda: current(7))  # a class: no __dict__ copied
    assert owner.cls() == 7 and owner.cls.__wrapped__ is int
    with pytest.raises(PatchError, match=r"^odc patch 'test': verls_module.gone is gone in this verl$"):
        odc_patches.replace_attr(owner, "gone", "test", doubled)

    def refuses(current):
        raise PatchError("odc patch 'test': changed")

    owner.other = verls
    with pytest.raises(PatchError, match="changed"):
        odc_patches.replace_attr(owner, "other", "test", refuses)
    assert owner.other is verls and made == [verls]


def test_the_layer_time_patch_finds_the_decoder_layers_of_actor_and_critic_models():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    config = Qwen2Config(**harness.TINY_QWEN2, num_labels=1)
    for model in (Qwen2ForCausalLM(config), Qwen2ForTokenClassification(config)):
        assert cpu_layer_time.decoder_layers(model) is model.model.layers
    with pytest.raises(ValueError, match="cpu_layer_time: found no decoder layers"):
        cpu_layer_time.decoder_layers(torch.nn.Linear(2, 2))


def test_verls_dataset_gives_images_as_qwen_vl_utils_would_without_it(stock_cpu):
    """Resized to whole merged patches within qwen_vl_utils' bounds (at least 4 tokens), transparency on white;
    a video refused in one line."""
    from PIL import Image
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cpu_vision_info.apply()
    small, exact = Image.new("RGBA", (30, 40), (255, 0, 0, 0)), Image.new("RGB", (56, 84), (0, 0, 255))
    content = [{"type": "image", "image": small}, {"type": "text", "text": "and"}, {"type": "image", "image": exact}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "two"}]
    images, videos, audios = RLHFDataset._process_multi_modal_info(messages, image_patch_size=14, config=None)
    assert [image.size for image in images] == [(56, 84), (56, 84)] and videos is None and audios is None
    assert {image.mode for image in images} == {"RGB"} and images[0].getpixel((0, 0)) == (255, 255, 255)
    assert images[1].tobytes() == exact.tobytes()
    video = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}]
    with pytest.raises(ValueError, match=r"^odc \(VERL_PLATFORM=cpu\): a video needs qwen_vl_utils"):
        RLHFDataset._process_multi_modal_info(video, image_patch_size=14, config=None)
