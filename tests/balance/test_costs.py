"""Cost models: the FLOP counts against a real transformers model's weights and Qwen2.5's published sizes."""

from __future__ import annotations

import pytest
from torch import nn

from odc_plugin.balance import QWEN2_5_PRESETS, FitCost, FlopsCost, TokenCost, VerlFlopsCost, get_cost_model

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 100,
}


def test_tokens_and_fit():
    assert TokenCost()(123) == 123
    assert FitCost(a=2.0, b=3.0)(10) == 230
    assert FitCost(a=0.5, b=0).costs([2, 4]) == [2, 8]


def test_flops_linear_term_is_two_flops_per_weight_forward_six_for_training():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False))
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    cost = FlopsCost.from_config(model.config)
    assert cost.linear_flops_per_token == 2 * weights
    # Causal attention: QK^T and PV each take s*s/2 multiply-adds (2 FLOPs) per head dim, head and layer.
    s, layers, heads, head_dim = 1000, 2, 4, 16
    attention = 2 * (2 * s * s // 2) * head_dim * heads * layers
    embedding = 2 * model.model.embed_tokens.weight.numel()  # a lookup, counted like the head as verl counts it
    assert cost(s) == 3 * ((2 * weights + embedding) * s + attention)


@pytest.mark.parametrize("config", [*QWEN2_5_PRESETS, "Qwen3-8B", "tiny"])
def test_verls_flops_counter_and_the_own_formula_agree_on_dense_qwen(config):
    """The flops cost of a dense Qwen is verl's FlopsCounter count; the own formula, its fallback for an
    architecture verl does not know, gives the same."""
    from transformers import Qwen2Config

    model = Qwen2Config(**TINY) if config == "tiny" else config
    verl, own = get_cost_model("flops", model=model), FlopsCost.from_config(model)
    assert isinstance(verl, VerlFlopsCost)
    lengths = [1, 100, 4096, 32768]
    assert verl.costs(lengths) == pytest.approx(own.costs(lengths), rel=1e-12)


def test_qwen2_5_7b_preset_matches_published_parameter_count():
    cost = FlopsCost.from_config("Qwen2.5-7B")
    non_embedding = 6.53e9  # model card; the untied LM head is one more hidden x vocab matrix
    lm_head = 3584 * 152064
    assert cost.linear_flops_per_token / 2 == pytest.approx(non_embedding + lm_head, rel=5e-3)


@pytest.mark.parametrize("name", list(QWEN2_5_PRESETS))
def test_presets_dict_and_pretrained_config_agree(name):
    from transformers import Qwen2Config

    from_dict = FlopsCost.from_config(dict(QWEN2_5_PRESETS[name]))
    assert FlopsCost.from_config(name) == from_dict == FlopsCost.from_config(Qwen2Config(**QWEN2_5_PRESETS[name]))
    assert from_dict.head_dim == (64 if name == "Qwen2.5-0.5B" else 128)


def test_get_cost_model():
    assert get_cost_model() == TokenCost()
    assert get_cost_model("flops") == get_cost_model("flops", model="Qwen2.5-7B")
    assert get_cost_model("flops").model_type == "qwen2"
    assert get_cost_model("flops", model=TINY) == FlopsCost(**TINY)  # no model_type: the own formula
    assert get_cost_model("fit", a=1, b=2) == FitCost(1, 2)
    fit = FitCost(1, 2)
    assert get_cost_model(fit) is fit


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("bogus",), {}, "unknown cost model 'bogus'"),
        (("fit",), {}, "bad options for the 'fit' cost model"),
        (("fit",), {"a": -1, "b": 1}, "a >= 0"),
        (("flops",), {"model": "Qwen9"}, "model 'Qwen9' is neither a preset \\(Qwen2.5-0.5B, .*\\) nor a directory"),
        (("flops",), {"model": {"hidden_size": 8}}, "lacks num_hidden_layers"),
        (("flops",), {"model": 5}, "must be a preset name, a dict or a PretrainedConfig, got 5"),
        ((TokenCost(),), {"a": 1}, "already built"),
    ],
)
def test_get_cost_model_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_cost_model(*args, **kwargs)


def test_moe_counts_the_parameters_a_token_passes_through():
    """The tiny Qwen3-MoE as transformers builds it: per token, attention, its top-k experts' share of the
    stacked expert tensors, the router and the (tied) head; not the other experts."""
    from odc_plugin.models import build_qwen3_moe

    model = build_qwen3_moe()
    config = model.config
    active = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "model.embed_tokens.weight":
            continue  # norms; the embedding is a lookup (the tied head below multiplies by it)
        share = config.num_experts_per_tok / config.num_experts if ".experts." in name else 1
        active += p.numel() * share
    active += model.lm_head.weight.numel()
    cost = FlopsCost.from_config(config)
    assert (cost.moe_layers, cost.num_experts, cost.num_experts_per_tok) == (2, 5, 2)
    assert cost.linear_flops_per_token / 2 == pytest.approx(active)
    every_expert = active + sum(p.numel() * (1 - 2 / 5) for n, p in model.named_parameters() if ".experts." in n)
    assert cost.dense().linear_flops_per_token / 2 == pytest.approx(every_expert)


def test_qwen3_30b_a3b_active_and_total_parameters():
    from transformers import Qwen3MoeConfig

    from odc_plugin.balance import PRESETS

    cost = FlopsCost.from_config("Qwen3-30B-A3B")
    assert cost == FlopsCost.from_config(Qwen3MoeConfig(**PRESETS["Qwen3-30B-A3B"]))
    embedding = 151936 * 2048
    # model card: 30.5B parameters in all, 3.3B activated
    assert cost.linear_flops_per_token / 2 + embedding == pytest.approx(3.3e9, rel=0.02)
    assert cost.dense().linear_flops_per_token / 2 + embedding == pytest.approx(30.5e9, rel=0.01)
    with pytest.raises(ValueError, match="num_experts_per_tok <= num_experts"):
        FlopsCost(**{**TINY, "num_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 8, "moe_layers": 2})
