"""The CPU trainer's assets: the shipped tiny models are those the golden metrics start from, on every
machine, and the cache serves them."""

from __future__ import annotations

import filecmp
import json

import pandas as pd
import pytest

from odc_plugin.verl.cpu import assets, text_assets
from tests.verl.golden import configs, golden_file, model_of


def test_the_shipped_model_is_the_one_every_golden_file_starts_from():
    for config in configs():
        shipped = assets.model_fingerprint(assets.SHIPPED / model_of(config))
        assert json.loads(golden_file(config).read_text())["assets"] == shipped, config


@pytest.mark.parametrize("model", assets.MODELS)
def test_the_cache_serves_the_shipped_model_and_replaces_another(tmp_path, model):
    got = assets.ensure_assets(str(tmp_path), log=lambda _: None, model=model)
    assert assets.model_fingerprint(got.model_dir) == assets.model_fingerprint(assets.SHIPPED / model)
    train, val = pd.read_parquet(got.train_file), pd.read_parquet(got.val_file)
    assert (len(train), len(val)) == (512, 64) and set(val["extra_info"].map(lambda e: e["split"])) == {"test"}
    # a cached model that is not the shipped one (older code, an interrupted copy) is written again
    weights = f"{got.model_dir}/model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    logged = []
    again = assets.ensure_assets(str(tmp_path), log=logged.append, model=model)
    assert again == got and len(logged) == 1
    assert assets.model_fingerprint(again.model_dir) == assets.model_fingerprint(assets.SHIPPED / model)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"grpo-cpu-{'' if model == 'qwen2' else model + '-'}v3"]


def test_refresh_warm_starts_a_model_that_transformers_and_the_cache_read(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fingerprint = assets.refresh("qwen2", tmp_path / "qwen2", steps=2)
    assert (
        fingerprint
        == assets.model_fingerprint(tmp_path / "qwen2")
        != assets.model_fingerprint(assets.SHIPPED / "qwen2")
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2")
    assert model.config.vocab_size == len(tokenizer) and tokenizer.eos_token == text_assets.IM_END
    # all but the weights come out byte for byte as shipped: the data and the tokenizer are the same everywhere
    names = sorted(p.name for p in (assets.SHIPPED / "qwen2").iterdir())
    assert sorted(p.name for p in (tmp_path / "qwen2").iterdir()) == names
    for name in names:
        if name != "model.safetensors":
            assert filecmp.cmp(tmp_path / "qwen2" / name, assets.SHIPPED / "qwen2" / name, shallow=False), name


def test_refresh_warm_starts_a_vision_language_model_that_verl_loads_with_its_processor(tmp_path):
    """As the text model's: all but the weights byte for byte as shipped, the processor (its own code
    among the files, transformers' remote code) loaded as verl loads it, by its class's name."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = tmp_path / assets.VL_MODEL
    assert assets.refresh(assets.VL_MODEL, out, steps=2) != assets.model_fingerprint(assets.SHIPPED / assets.VL_MODEL)
    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and processor.tokenizer.eos_token == text_assets.IM_END
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    names = sorted(p.name for p in (assets.SHIPPED / assets.VL_MODEL).iterdir())
    assert sorted(p.name for p in out.iterdir()) == names and "vl_processor.py" in names
    for name in names:
        if name != "model.safetensors":
            assert filecmp.cmp(out / name, assets.SHIPPED / assets.VL_MODEL / name, shallow=False), name
