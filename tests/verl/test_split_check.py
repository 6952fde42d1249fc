"""odc_split's start-up check (odc_plugin/verl/split.py, `SplitMicroBatches.check`) on 4 CPU gloo ranks: the
odc engine with odc_split=auto runs a sequence whole and split over 2 ranks when it is built. Under SDPA, whose
heads odc's CPU patch exchanges (patches/cpu_ulysses_sdpa.py), the two agree and the check's figures reach
the metrics; under eager attention, which nothing exchanges, and in a model that mixes tokens outside attention
(LFM2's convolutions), every rank refuses at start with the same line."""

from __future__ import annotations

import os
import re

import pytest

from odc_plugin.verl.config import ODCEngineConfig
from odc_plugin.verl.split import CONTEXT, ROUNDING
from tests.verl import harness as H

WORLD = 4


def _built(rank, world_size, model_dir, attention):
    """The check's figures on this rank, or the line the engine was refused with."""
    try:
        worker = H.build_engine(
            "language_model",
            "odc",
            model_dir,
            engine_config_cls=ODCEngineConfig,
            engine_kwargs={"odc_split": "auto"},
            attn_implementation=attention,
        )
    except ValueError as e:
        return str(e)
    return dict(worker.engine.odc_split.metrics)


def _tiny_lfm2(out_dir: str) -> str:
    """A model whose first layer mixes tokens by a causal convolution, not attention (LFM2's short conv)."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        **{k: H.TINY_QWEN2[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")},
        num_key_value_heads=2,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
        max_position_embeddings=512,
        architectures=["Lfm2ForCausalLM"],
    )
    torch.manual_seed(0)
    path = os.path.join(out_dir, "tiny_lfm2")
    Lfm2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))


def test_a_split_that_computes_the_whole_sample_passes_and_says_so(qwen2):
    checked = H.run_on_ranks(_built, WORLD, qwen2, "sdpa", plugin_modules=H.PLUGIN)
    print(f"sdpa: {checked[0]}")
    assert all(c == checked[0] for c in checked), checked
    assert checked[0]["odc/split/check_difference"] < 1e-4 and checked[0]["odc/split/check_s"] > 0
    # 4 ranks, groups of 2 and 4: [0, 1], [2, 3], [0, 1, 2, 3]; gloo's connections hold no device memory
    assert checked[0]["odc/split/groups"] == 3 and checked[0]["odc/split/groups_bytes"] == 0


@pytest.mark.parametrize("model, attention", [("qwen2", "eager"), ("lfm2", "sdpa")])
def test_a_split_that_computes_otherwise_is_refused_at_start_on_every_rank(model, attention, qwen2, tmp_path):
    model_dir = qwen2 if model == "qwen2" else _tiny_lfm2(str(tmp_path))
    refused = H.run_on_ranks(_built, WORLD, model_dir, attention, plugin_modules=H.PLUGIN)
    print(f"{model}, {attention}: {refused[0]}")
    assert all(r == refused[0] for r in refused), refused
    assert isinstance(refused[0], str) and "\n" not in refused[0]
    assert refused[0].startswith("odc_split=auto: this model computes a sequence split over 2 ranks otherwise")
    assert f"attn_implementation={attention}" in refused[0] and refused[0].endswith("or set odc_split=off")
    found = re.search(
        r"outputs (\S+) apart, where rounding moves them by (\S+) and its first tokens by (\S+)\)", refused[0]
    )
    apart, rounding, context = map(float, found.groups())
    assert apart > max(ROUNDING * rounding, CONTEXT * context)
