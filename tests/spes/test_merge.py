"""The merging warm-up against the formula written out, and its schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from odc_plugin.spes import SPESConfig, merge_alpha, merge_experts, moe_layers, split_experts
from odc_plugin.spes.experts import MoELayer
from odc_plugin.spes.models import build_olmoe


class TwoDimExperts(nn.Module):
    """Four experts, hidden size 2, intermediate size 1: gate rows at 0, 10, 50 and 120 degrees."""

    intermediate_dim = 1

    def __init__(self):
        super().__init__()
        angles = [0.0, 10.0, 50.0, 120.0]
        self.gate_up_proj = nn.ParameterList(
            nn.Parameter(torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))], [e + 1.0, -e]]))
            for e, a in enumerate(angles)
        )
        self.down_proj = nn.ParameterList(nn.Parameter(torch.tensor([[2.0 * e], [1.0 - e]])) for e in range(4))


def test_small_case_by_hand():
    module = TwoDimExperts()
    before = [[p.detach().clone() for p in (module.gate_up_proj[e], module.down_proj[e])] for e in range(4)]
    alpha = 0.2
    merge_experts([MoELayer("experts", module)], alpha, topk=2)
    # nearest two by angle: 0 -> {10, 50}, 10 -> {0, 50}, 50 -> {10, 0}, 120 -> {50, 10}
    donors = {0: (1, 2), 1: (0, 2), 2: (1, 0), 3: (2, 1)}
    for e, (a, b) in donors.items():
        for w, got in enumerate((module.gate_up_proj[e], module.down_proj[e])):
            own = before[e][w]
            # donors as they were before any expert changed
            want = own + alpha * ((before[a][w] - own) + (before[b][w] - own)) / 2
            torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)


def test_merge_on_a_model_matches_the_formula():
    model = split_experts(build_olmoe("test", seed=1))
    layers = moe_layers(model)
    with torch.no_grad():  # experts apart from their initialization, so that similarities differ
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    before = [
        [[p.detach().clone() for p in layer.expert_params(e)] for e in range(layer.num_experts)] for layer in layers
    ]
    alpha, topk = 0.3, 2
    merge_experts(layers, alpha, topk)
    for layer, experts in zip(layers, before):
        gate = torch.stack([ws[0][: layer.gate_rows].reshape(-1) for ws in experts])
        sim = F.cosine_similarity(gate[:, None], gate[None, :], dim=2)
        for e, ws in enumerate(experts):
            order = [d for d in sim[e].argsort(descending=True).tolist() if d != e][:topk]
            own = torch.cat([w.reshape(-1) for w in ws])
            task = torch.stack([torch.cat([w.reshape(-1) for w in experts[d]]) - own for d in order]).mean(0)
            got = torch.cat([p.detach().reshape(-1) for p in layer.expert_params(e)])
            torch.testing.assert_close(got, own + alpha * task, rtol=1e-6, atol=1e-7)


def test_topk_must_leave_the_expert_out():
    with pytest.raises(ValueError, match=r"merge_topk must be below the experts per layer \(4\).*got 4"):
        merge_experts([MoELayer("experts", TwoDimExperts())], 0.1, topk=4)


def test_alpha_schedule_is_the_reference_one():
    config = SPESConfig()  # merge every 500 steps, alpha 0.05 falling to 0 at step 20000
    assert merge_alpha(500, config) == pytest.approx(0.05 * (1 - 500 / 20000))
    assert merge_alpha(10000, config) == pytest.approx(0.025)
    assert merge_alpha(700, config) == 0.0
    assert merge_alpha(20000, config) == 0.0 and merge_alpha(40000, config) == 0.0
    assert merge_alpha(500, SPESConfig(mode="fedavg")) == 0.0
    assert merge_alpha(500, SPESConfig(merge_alpha_start=0.0)) == 0.0
