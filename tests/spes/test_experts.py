"""Split experts compute what the fused ones do; frozen experts hold no gradient and no optimizer state."""

from __future__ import annotations

import pytest
import torch

from odc_plugin.models import build_qwen2
from odc_plugin.spes import SPESConfig, moe_layers, prepare_experts, split_experts, state_bytes, trainable_parameters
from odc_plugin.spes.models import build_olmoe, lm_loss

TOKENS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))


def test_split_experts_keep_outputs_and_gradients():
    fused, split = build_olmoe("test", seed=3), split_experts(build_olmoe("test", seed=3))
    loss_fused, loss_split = lm_loss(fused, TOKENS), lm_loss(split, TOKENS)
    assert torch.equal(loss_fused, loss_split)
    loss_fused.backward()
    loss_split.backward()
    grads = dict(split.named_parameters())
    for name, p in fused.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")):
            for e in range(p.shape[0]):
                torch.testing.assert_close(grads[f"{name}.{e}"].grad, p.grad[e], rtol=1e-6, atol=1e-8)
        else:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-6, atol=1e-8)


def test_models_without_fused_experts_are_refused():
    with pytest.raises(ValueError, match="split_experts found no MoE experts module"):
        split_experts(build_qwen2("tiny"))
    with pytest.raises(ValueError, match="call split_experts"):
        moe_layers(build_olmoe("test"))


def test_frozen_experts_get_no_gradient_and_no_optimizer_state():
    model = build_olmoe("test", seed=0)
    owned = prepare_experts(model, SPESConfig(), num_nodes=2, node=1)
    assert owned == range(2, 4)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)
    lm_loss(model, TOKENS).backward()
    opt.step()
    layers = moe_layers(model)
    for layer in layers:
        for e in range(layer.num_experts):
            for p in layer.expert_params(e):
                assert (p.grad is not None) == (e in owned) == p.requires_grad == (p in opt.state)
    frozen = [p for layer in layers for e in (0, 1) for p in layer.expert_params(e)]
    trainable = trainable_parameters(model)
    state = state_bytes(model, opt)
    assert state.counted == 16 * sum(p.numel() for p in trainable)
    assert state.measured == state.counted + 4 * len(trainable)  # Adam's step counters
    assert state.frozen == 4 * sum(p.numel() for p in frozen)


def test_baseline_modes_train_every_expert():
    model = build_olmoe("test", seed=0)
    assert prepare_experts(model, SPESConfig(mode="fedavg"), num_nodes=2, node=1) == range(4)
    assert all(p.requires_grad for p in model.parameters())
