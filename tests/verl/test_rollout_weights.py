"""The `hf` rollout server takes the weights verl's trainer sends: MoE experts one by one (verl's own
unfuse_moe_params) into transformers 5's fused experts, and LoRA with merge=False (base weights named by
verl's replace_lora_wrapper, then the adapter as peft saves it), and generates what the trainer's model
would. The server runs in this process (no Ray), as the Ray actor runs it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from odc_plugin.models import build_qwen2, build_qwen3_moe
from odc_plugin.verl.cpu.rollout import HFRolloutServer

PROMPT = [5, 17, 42, 8, 99, 3]


def server_for(model, path) -> HFRolloutServer:
    model.save_pretrained(path)
    config = SimpleNamespace(dtype="float32", full_determinism=False, seed=0, max_model_len=None, response_length=6)
    # tiny's odd sizes: the eager experts (grouped_mm wants 16-byte strides)
    override = {"attn_implementation": "sdpa", "experts_implementation": "eager"}
    return HFRolloutServer(config, SimpleNamespace(path=str(path), override_config=override), 0)


def unpacked(model):
    """A test model with plain attention (the builders' packed attention needs position ids)."""
    model.set_attn_implementation("sdpa")
    return model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROMPT])).logits


def greedy(server: HFRolloutServer) -> list[int]:
    out = asyncio.run(server.generate("r", PROMPT, {"temperature": 0, "max_tokens": 6}))
    return out.token_ids


def test_moe_experts_sent_one_by_one_load_into_the_fused_layout(tmp_path):
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    server = server_for(build_qwen3_moe(seed=0), tmp_path / "init")
    trained = unpacked(build_qwen3_moe(seed=1))  # the trainer's weights: different everywhere
    sent = dict(unfuse_moe_params(trained.state_dict().items(), "qwen3_moe"))
    assert "model.layers.0.mlp.experts.4.up_proj.weight" in sent  # what the KeyError used to name
    asyncio.run(server.update_weights(sent, global_steps=1))
    own = server.model.state_dict()
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(own[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(logits(server.model), logits(trained), rtol=1e-6, atol=1e-6)
    tokens = trained.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=6)[0, len(PROMPT) :].tolist()
    assert greedy(server) == tokens


def test_moe_weights_that_do_not_fit_are_named(tmp_path):
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    server = server_for(build_qwen3_moe(seed=0), tmp_path / "init")
    sent = dict(unfuse_moe_params(build_qwen3_moe(seed=1).state_dict().items(), "qwen3_moe"))
    partial = {k: v for k, v in sent.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
    with pytest.raises(
        KeyError,
        match=r"sent part of model.layers.1.mlp.experts's experts; missing "
        r"\['model.layers.1.mlp.experts.2.up_proj.weight'\]",
    ):
        asyncio.run(server.update_weights(partial))
    odd = {**sent, "model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(30, 15)}
    with pytest.raises(
        ValueError,
        match=r"sent model.layers.0.mlp.experts.3.down_proj.weight with shape \[30, 15\], "
        r"expert 0's is \[30, 14\]",
    ):
        asyncio.run(server.update_weights(odd))
    wide = {**sent, **{f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.zeros(30, 15) for e in range(5)}}
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.mlp.experts.down_proj with shape \[5, 30, 15\], the "
        r"rollout model holds it as \[5, 30, 14\]",
    ):
        asyncio.run(server.update_weights(wide))


def test_lora_unmerged_base_then_adapter_generates_as_the_trainer_model(tmp_path):
    from peft import LoraConfig, get_peft_model
    from peft.utils.save_and_load import get_peft_model_state_dict
    from verl.utils.fsdp_utils import replace_lora_wrapper

    server = server_for(build_qwen2("tiny", seed=0), tmp_path / "init")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    trainer = get_peft_model(unpacked(build_qwen2("tiny", seed=1)), config)
    torch.manual_seed(2)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    trainer.eval()
    # verl's base sync: the base model's weights, adapted layers' named as vLLM's LoRA layers hold them
    base = trainer.base_model.model.state_dict()
    base_sent = {
        replace_lora_wrapper(name.replace(".base_layer", ""), config): value
        for name, value in base.items()
        if "lora_" not in name
    }
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in base_sent
    asyncio.run(server.update_weights(base_sent, global_steps=1))  # the adapter server sends no config here
    for step in (1, 2):  # the first adapter, then a step's update of it
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 0.1 * step)
        adapter = get_peft_model_state_dict(trainer)
        asyncio.run(server.update_weights(adapter, global_steps=step, peft_config=config.to_dict()))
        torch.testing.assert_close(logits(server.model), logits(trainer), rtol=1e-6, atol=1e-6)
    with trainer.disable_adapter():
        assert not torch.allclose(logits(trainer), logits(server.model), atol=1e-4)  # the adapter matters
    tokens = trainer.generate(input_ids=torch.tensor([PROMPT]), do_sample=False, max_new_tokens=6)
    assert greedy(server) == tokens[0, len(PROMPT) :].tolist()
