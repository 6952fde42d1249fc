"""verl's vision-language GRPO job (its geo3k example, examples/grpo_trainer/run_qwen2_5_vl-7b.sh:
`data.image_key=images`, a Qwen2.5-VL, the KL loss) on this machine's CPU: the tiny Qwen2.5-VL and its data
set of pictures (odc_plugin/verl/cpu/vl_assets.py), the `hf` rollout generating from a prompt's images, the
model's packed micro-batches on CPU, and verl's real `main_ppo` under fsdp2 and under odc on 2 ranks, with
samples of no image, one and several: odc trains as fsdp2 does, step by step, on uneven LB-Mini shares.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from odc_plugin.verl.cpu import assets, grpo, vl_assets
from odc_plugin.verl.cpu.assets import VL_MODEL, ensure_assets
from tests.verl import golden
from tests.verl.trainer_runs import close, train, worst_difference

STEPS = 2
SMALL = golden.VL_BATCH
PROMPTS = 4  # a step's prompts in SMALL, of GROUP_SIZE responses each: one mini-batch of 16 samples
# rank 1 five times slower, in both runs: the auto cost's rank speeds make LB-Mini's shares uneven (golden.py)
SLOW_RANKS = golden.EXAMPLE_SLOW_RANKS


def load_shipped():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = assets.SHIPPED / VL_MODEL
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa").eval()
    return model, AutoProcessor.from_pretrained(path, trust_remote_code=True)


def prompt_inputs(model, processor, problem: vl_assets.VLProblem) -> dict:
    """A problem's prompt as verl's agent loop makes it: the ids with their image tokens expanded, the images'
    pixel values and grids, and verl's 4 rows of position ids (the text's, then the multi-axis rope's)."""
    chat = vl_assets.messages(problem)
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    images = [part["image"] for part in chat[0]["content"] if part["type"] == "image"] if problem.images else None
    inputs = processor(text=[text], images=images, return_tensors="pt")
    rope, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw")
    )
    length = inputs["input_ids"].shape[1]
    out = {"input_ids": inputs["input_ids"], "position_ids": torch.cat([torch.arange(length).view(1, 1, -1), rope])}
    if images:
        out.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"], images=images)
    return out


def test_the_data_set_holds_prompts_of_no_image_one_and_several_in_verls_batches():
    """geo3k's layout; and the batches verl's own sampler draws for the runs below hold each kind."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import create_rl_sampler

    data = pd.read_parquet(ensure_assets(model=VL_MODEL).train_file)
    counts = data["images"].map(len)
    assert set(counts) == {0, 1, 2, 3}
    pictured = data[counts > 0].iloc[0]
    assert pictured["prompt"][0]["content"].count("<image>") == len(pictured["images"])
    assert set(pictured["images"][0]) == {"bytes", "path"} and pictured["reward_model"]["style"] == "rule"
    sampler = create_rl_sampler(OmegaConf.create({"shuffle": True, "seed": 1}), list(range(len(data))))
    drawn = list(sampler)[: STEPS * PROMPTS]  # data.seed=1, as odc-grpo-cpu sets it
    assert {min(c, 2) for c in counts.iloc[drawn]} == {0, 1, 2}


def test_the_hf_rollout_generates_from_the_images_it_is_sent(tmp_path):
    """The same prompt ids (a picture is its image tokens, whatever it shows) with other pictures: other
    log-probs and another sampling seed; a prompt with images for a text model is refused in one line."""
    from odc_plugin.verl.cpu.rollout import HFRolloutServer

    config = SimpleNamespace(dtype="float32", full_determinism=True, seed=0, max_model_len=None, response_length=8)
    model_config = SimpleNamespace(
        path=str(assets.SHIPPED / VL_MODEL), override_config={"attn_implementation": "sdpa"}, trust_remote_code=True
    )
    server = HFRolloutServer(config, model_config, 0)
    one = [p for p in vl_assets.make_vl_problems(30, seed=5) if len(p.images) == 1]
    first, second = (prompt_inputs(server.model, server.processor, p) for p in one[:2])
    assert first["input_ids"].tolist() == second["input_ids"].tolist()
    params = {"temperature": 0, "logprobs": True}
    outputs = [
        asyncio.run(server.generate("r", p["input_ids"][0].tolist(), params, image_data=p["images"]))
        for p in (first, second, first)
    ]
    assert outputs[0].log_probs != outputs[1].log_probs and outputs[0] == outputs[2]
    text = SimpleNamespace(path=str(assets.SHIPPED / "qwen2"), override_config={"attn_implementation": "sdpa"})
    with pytest.raises(ValueError, match="^rollout 'hf': a prompt with images, for a model without a vision tower$"):
        asyncio.run(HFRolloutServer(config, text, 0).generate("r", [5, 6], params, image_data=first["images"]))


def test_a_packed_micro_batch_attends_within_each_sequence_on_cpu(monkeypatch):
    """verl's Qwen2.5-VL forward over a packed micro-batch (use_remove_padding: no mask, its 4 rows of position
    ids), with the attention patches/cpu_vl_attention.py keeps: each sequence's logits are those it gets alone,
    a text's (alone: verl's blank picture, patches/cpu_vl_text_batches.py), a picture's and several pictures'
    alike."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl
    from verl.models.transformers import monkey_patch, qwen2_vl

    from odc_patches import cpu_vl_attention, cpu_vl_text_batches

    for module, prefix in ((modeling_qwen2_5_vl, "Qwen2_5_VL"), (modeling_qwen2_vl, "Qwen2VL")):
        for name in ("ForConditionalGeneration", "Model", "Attention"):  # what verl's patch changes, put back after
            cls = getattr(module, prefix + name)
            monkeypatch.setattr(cls, "forward", cls.forward)
    monkeypatch.setattr(monkey_patch, "apply_monkey_patch", monkey_patch.apply_monkey_patch)
    monkeypatch.setattr(qwen2_vl, "_get_input_embeds", qwen2_vl._get_input_embeds)
    cpu_vl_attention.apply()
    cpu_vl_text_batches.apply()  # the text's micro-batch: verl's blank picture
    model, processor = load_shipped()
    monkey_patch.apply_monkey_patch(model, use_remove_padding=True)
    samples = [prompt_inputs(model, processor, p) for p in vl_assets.make_vl_problems(3, seed=5)]
    assert [len(s.get("images", ())) for s in samples][:2] == [0, 1] and len(samples[2]["images"]) > 1

    def logits(parts: list[dict]) -> torch.Tensor:
        pictured = [p for p in parts if "images" in p]
        with torch.no_grad():
            return model(
                input_ids=torch.cat([p["input_ids"] for p in parts], -1),
                position_ids=torch.cat([p["position_ids"] for p in parts], -1),
                pixel_values=torch.cat([p["pixel_values"] for p in pictured]) if pictured else None,
                image_grid_thw=torch.cat([p["image_grid_thw"] for p in pictured]) if pictured else None,
                use_cache=False,  # as verl's engine calls it: a cache would leave the packed sequences unmasked
            ).logits[0]

    packed, start = logits(samples), 0
    for sample in samples:
        alone = logits([sample])
        torch.testing.assert_close(packed[start : start + len(alone)], alone, rtol=1e-5, atol=1e-5)
        start += len(alone)


@pytest.mark.parametrize("lengths", [[43], [43, 43], [43, 50, 43]], ids=["one sample", "one length", "lengths"])
def test_a_share_of_rope_positions_is_laid_out_as_verls_engine_reads_it(lengths):
    """TransferQueue's packing of a share of one sample, or of one length, is ragged over the 4 rows, and verl's
    maybe_fix_3d_position_ids then mislabels it; lay_out gives each sample back, ragged over its tokens, and
    verl's packing of micro-batches takes it."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    from odc_plugin.verl.mrope_positions import lay_out

    want = [torch.arange(4 * n).view(4, n) + 1000 * i for i, n in enumerate(lengths)]
    data = TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor([torch.zeros(n) for n in lengths], layout=torch.jagged),
            "position_ids": torch.nested.as_nested_tensor(want, layout=torch.jagged),
        },
        batch_size=[len(lengths)],
    )
    tu.maybe_fix_3d_position_ids(data)  # what verl's engine does first
    lay_out(data)
    assert all(torch.equal(got, w) for got, w in zip(data["position_ids"].unbind(), want))
    micro_batches, _ = rearrange_micro_batches(data, max_token_len=1024, dp_group=None, same_micro_num_in_dp=False)
    assert [tuple(m["position_ids"].values().shape) for m in micro_batches] == [(4, sum(lengths))]


@pytest.fixture(scope="module")
def vl_runs(tmp_path_factory):
    """odc-grpo-cpu's VL job (--model qwen2_5_vl) with the KL loss, 4 prompts a step, rank 1 slowed: fsdp2
    (saving every step), odc, and odc resuming fsdp2's step-1 checkpoint for step 2."""
    out, vl = tmp_path_factory.mktemp("vl"), ensure_assets(model=VL_MODEL)
    runs = {
        s: train(
            out, vl, "vl", s, STEPS, [*SMALL, *(["trainer.save_freq=1"] if s == "fsdp2" else [])], slow_ranks=SLOW_RANKS
        )
        for s in grpo.STRATEGIES
    }
    step_1 = out / "vl" / "checkpoints" / "global_step_1"
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={step_1}"]
    runs["odc resumed"] = train(out, vl, "vl-resumed", "odc", STEPS, [*SMALL, *resume], slow_ranks=SLOW_RANKS)
    return runs


def test_odc_trains_the_vision_language_job_as_fsdp2_step_by_step(vl_runs):
    fsdp2, odc = (vl_runs[s] for s in grpo.STRATEGIES)
    fsdp2.assert_ok(STEPS)
    odc.assert_ok(STEPS)
    for run in (fsdp2, odc):  # the processor verl loaded: without it verl would have refused the images
        assert "Failed to create processor" not in run.log()
    assert "odc: ODCEngineWithLMHead on 2 ranks" in odc.log()
    worst, where = worst_difference(fsdp2.metrics, odc.metrics, STEPS, golden.CLOSE, golden.CLOSE)
    print(f"worst relative difference odc vs fsdp2: {worst:.2g} ({where})")
    lines = golden.compare({"fsdp2": fsdp2.metrics, "odc": odc.metrics}, "grpo_cpu_vl")
    assert not lines, "\n".join([*lines, "if the change is meant to move them: python -m tests.verl.golden"])
    assert fsdp2.metrics[1]["actor/grad_norm"] > 0  # rewards vary within groups: something to learn


def test_lb_mini_moves_samples_with_their_images_between_ranks(vl_runs):
    """From step 2 the auto cost knows rank 1 is slow and gives it fewer samples: moved with their pixel
    values, grids and rope positions (else the step above would differ from fsdp2's)."""
    odc = vl_runs["odc"].metrics[STEPS]
    assert odc["odc_balance/samples_min"] < odc["odc_balance/samples_max"], odc


def test_odc_resumes_the_vision_language_job_from_an_fsdp2_checkpoint(vl_runs):
    """The resumed run starts after the checkpoint's step, and its step is fsdp2's: the weights and optimizer
    state it loaded are the ones fsdp2 saved (the same rollouts, the same update)."""
    fsdp2, resumed = vl_runs["fsdp2"], vl_runs["odc resumed"]
    assert resumed.result.returncode == 0, grpo.last_error(resumed.result.log_file)
    assert sorted(resumed.metrics) == [STEPS], "the resumed run starts after the checkpoint's step"
    a, b = fsdp2.metrics[STEPS], resumed.metrics[STEPS]
    for key in golden.EXACT:
        assert a[key] == b[key], (key, a[key], b[key])
    for key in golden.CLOSE:
        assert close(a[key], b[key], golden.RTOL), (key, a[key], b[key])
