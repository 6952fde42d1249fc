"""Length generators and loaders, and what a verl user has (a data set, rollout dumps, the metrics file)
read from files written the way verl writes them."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from odc_plugin.balance import LengthSample, load_lengths, planner, rl_math_like, sft_long_context_like
from odc_plugin.balance.lengths import logged_step_lengths, plan_lengths
from odc_plugin.balance.verl_data import load_tokenizer, prompt_lengths, rollout_dump_lengths
from odc_plugin.verl.cpu.text_assets import prompt_messages


def test_rl_math_like_shape():
    s = rl_math_like(20000, max_prompt_length=512, max_response_length=4096, seed=1)
    prompts, responses = np.array(s.prompt_lens), np.array(s.response_lens)
    assert s.total == (prompts + responses).tolist()
    assert prompts.min() >= 16 and prompts.max() <= 512 and responses.min() >= 1
    assert 100 <= np.percentile(prompts, 5) and np.percentile(prompts, 95) <= 400
    assert 500 <= np.median(responses) <= 2000
    assert 0.03 <= np.mean(responses == 4096) <= 0.2  # the pile-up of truncated responses
    assert rl_math_like(50, seed=3) == rl_math_like(50, seed=3) != rl_math_like(50, seed=4)


def test_agent_like_trajectories_have_the_longest_tail():
    """Multi-turn trajectories: most end within a couple of turns, a few run to the 16k cap; the tail
    (99th percentile over the median) is longer than a single-turn rl profile's at the same cap."""
    from odc_plugin.balance.lengths import agent_like, plan_lengths

    s = agent_like(20000, seed=1)
    responses = np.array(s.response_lens)
    assert max(s.prompt_lens) <= 2048 and responses.min() >= 1 and responses.max() <= 16384
    assert 1000 <= np.median(responses) <= 4000 and 0 < np.mean(responses == 16384) < 0.05
    rl = np.array(rl_math_like(20000, max_response_length=16384, seed=1).response_lens)
    tail = np.percentile(responses, 99) / np.median(responses)
    assert tail > np.percentile(rl, 99) / np.median(rl)
    assert agent_like(50, seed=3) == agent_like(50, seed=3) != agent_like(50, seed=4)
    source = plan_lengths("agent", max_prompt_length=2048, max_response_length=16384)
    assert "multi-turn" in source.what and len(source.draw(8, 0)) == 8 and source.longest == 2048 + 16384


def test_sft_long_context_like_shape():
    s = sft_long_context_like(20000, max_length=32768, seed=1)
    total = np.array(s.total)
    assert min(s.prompt_lens) >= 1 and min(s.response_lens) >= 1 and total.max() <= 32768
    assert np.median(total) < 4096 and np.mean(total > 16384) > 0.1
    # Long samples hold most of the tokens.
    assert total[total > 4096].sum() > 0.5 * total.sum()
    assert sft_long_context_like(10, max_length=2, seed=0).total == [2] * 10


def test_length_sample_checks_lengths_match():
    with pytest.raises(ValueError, match="2 prompt lengths but 1 response lengths"):
        LengthSample([1, 2], [3])


def test_load_lengths(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([3, 1, 4]))
    (tmp_path / "a.txt").write_text("3\n1\n\n4\n")
    pq.write_table(
        pa.table({"n": [3, 1, 4], "ids": [[0, 0, 0], [0], [0, 0, 0, 0]], "s": ["a", "b", "c"]}), tmp_path / "a.parquet"
    )
    for spec in ("a.json", "a.txt", "a.parquet:n", "a.parquet:ids"):
        assert load_lengths(str(tmp_path / spec)) == [3, 1, 4]


@pytest.mark.parametrize(
    "name,content,spec,match",
    [
        ("b.txt", "3\nx\n", "b.txt", r"b.txt:2: expected one integer length per line, got 'x'"),
        ("b.json", "[1, -1]", "b.json", r"length 1 must be a non-negative integer, got -1"),
        ("b.json", '{"a": 1}', "b.json", r"expected a JSON list of lengths, got dict"),
        ("b.txt", "\n", "b.txt", r"no lengths"),
        (None, None, "missing.txt", r"length file '.*missing.txt' not found"),
        (None, None, "a.parquet:nope", r"has no column 'nope'; columns: n, s"),
        (None, None, "a.parquet:s", r"a.parquet:s is string; expected integer lengths or lists of token ids"),
        ("b.json", "[0, 0, 0]", "b.json", r"b.json: every length is 0, nothing to balance"),
        ("b.json", "not json", "b.json", r"b.json: not JSON \(Expecting value.*\); expected a JSON list of lengths"),
        (None, None, "a.parquet", r"a.parquet looks like a parquet file; pass .*a.parquet:COLUMN"),
        ("b.txt", b"\xff\xfe1\n", "b.txt", r"b.txt: not UTF-8 text \(invalid start byte at byte 0\)"),
    ],
)
def test_load_lengths_errors(tmp_path, name, content, spec, match):
    pq.write_table(pa.table({"n": [1], "s": ["a"]}), tmp_path / "a.parquet")
    if name:
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=match):
        load_lengths(str(tmp_path / spec))


# --- what a verl user has, written the way verl writes it -------------------------------------------------


@pytest.fixture(scope="module")
def verl_files(tmp_path_factory):
    """A tiny tokenizer with a chat template (the CPU run's, odc_plugin.verl.cpu.assets), a data set in verl's
    RL parquet layout written by Hugging Face datasets as verl's data_preprocess scripts write it, and the
    problems behind it."""
    import datasets

    from odc_plugin.verl.cpu.text_assets import build_tokenizer, make_problems
    from odc_plugin.verl.data import GSM8K, GSM8K_INSTRUCTION, make_row

    root = tmp_path_factory.mktemp("verl_files")
    problems = make_problems(64, seed=0)
    tokenizer = build_tokenizer(problems)
    tokenizer.save_pretrained(root / "model")
    rows = [make_row(GSM8K, p.question, GSM8K_INSTRUCTION, p.answer, "train", i) for i, p in enumerate(problems)]
    datasets.Dataset.from_list(rows).to_parquet(str(root / "train.parquet"))
    return root, problems, load_tokenizer(str(root / "model"))


def test_prompt_lengths_are_the_chat_template_tokens_verl_counts(verl_files):
    """`DATA.parquet:prompt` with the tokenizer: each prompt's chat template tokens, the count verl's
    RLHFDataset filters overlong prompts by (the rows it keeps at a limit are exactly those counted within)."""
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    root, problems, tokenizer = verl_files
    lengths = prompt_lengths(f"{root}/train.parquet:prompt", tokenizer)
    expected = [
        len(
            tokenizer.apply_chat_template(
                prompt_messages(p), add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in problems
    ]
    assert lengths == expected
    limit = sorted(lengths)[len(lengths) // 2]
    config = {"max_prompt_length": limit, "filter_overlong_prompts": True, "cache_dir": str(root / "cache")}
    kept = RLHFDataset(str(root / "train.parquet"), tokenizer, OmegaConf.create(config)).dataframe
    assert sorted(row["extra_info"]["index"] for row in kept) == [i for i, n in enumerate(lengths) if n <= limit]
    # planned as prompts of the data set plus responses of the rl profile
    source = plan_lengths(f"{root}/train.parquet:prompt", tokenizer=str(root / "model"), max_response_length=256)
    prompts = set(lengths)
    assert source.longest == max(lengths) + 256 and source.steps == 0
    drawn = np.array(source.draw(500, 3))
    responses = np.array(rl_math_like(500, max_response_length=256, seed=3).response_lens)
    assert set((drawn - responses).tolist()) <= prompts


def test_a_vision_language_data_set_counts_each_image_as_the_tokens_its_processor_expands_it_into(tmp_path, capsys):
    """verl's VL data set (geo3k's layout: `<image>` placeholders, an `images` column) with the model's folder:
    each prompt's count is what the model's processor, as verl's agent loop calls it, makes of the prompt
    and its pictures (0, 1 and several); odc-plan plans it; a text model's folder is refused in one line."""
    import io

    from PIL import Image
    from transformers import AutoProcessor

    from odc_plugin.balance.verl_data import _with_images, load_image_processor
    from odc_plugin.verl.cpu.assets import VL_MODEL, ensure_assets

    vl, text = ensure_assets(log=lambda _: None, model=VL_MODEL), ensure_assets(log=lambda _: None)
    spec = f"{vl.train_file}:prompt"
    lengths = prompt_lengths(spec, load_tokenizer(vl.model_dir), load_image_processor(vl.model_dir))
    processor = AutoProcessor.from_pretrained(vl.model_dir, trust_remote_code=True, local_files_only=True)
    table = pq.read_table(vl.train_file, columns=["prompt", "images"]).to_pylist()[:24]
    seen = set()
    for row, counted in zip(table, lengths):
        text_prompt = processor.apply_chat_template(
            _with_images(row["prompt"]), add_generation_prompt=True, tokenize=False
        )
        pictures = [Image.open(io.BytesIO(i["bytes"])).convert("RGB") for i in row["images"] or []]
        assert counted == len(processor(text=[text_prompt], images=pictures or None)["input_ids"][0])
        seen.add(len(pictures))
    assert {0, 1} <= seen and max(seen) >= 2, seen
    planner.main(["--lengths", spec, "--tokenizer", vl.model_dir, "--ranks", "2", "--minibatch-sizes", "4"])
    assert "prompts of" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"has images \(column 'images'\) and --tokenizer's model folder no image "):
        prompt_lengths(spec, load_tokenizer(text.model_dir), load_image_processor(text.model_dir))


def test_lb_mini_moves_work_off_the_rank_of_a_prompt_heavy_with_pictures(tmp_path):
    """The images' tokens in LB-Mini's cost: eight prompts of one text on 2 ranks, verl's split 4 | 4, stay as
    they are; the same prompts with one carrying three large pictures (their tokens counted as the model's
    processor expands them) leave that prompt's rank fewer samples."""
    import io

    import pandas as pd
    from PIL import Image

    from odc_plugin.balance import lb_mini
    from odc_plugin.balance.common import rank_shares
    from odc_plugin.balance.verl_data import load_image_processor
    from odc_plugin.verl.cpu.assets import VL_MODEL, ensure_assets

    vl = ensure_assets(log=lambda _: None, model=VL_MODEL)
    picture = io.BytesIO()
    Image.new("RGB", (448, 448), "white").save(picture, format="PNG")
    heavy = {"bytes": picture.getvalue(), "path": None}
    rows = [
        {"prompt": [{"role": "user", "content": "<image>" * n + "How many squares?"}], "images": [heavy] * n}
        for n in (3, 0, 0, 0, 0, 0, 0, 0)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "data.parquet")
    tokenizer, images = load_tokenizer(vl.model_dir), load_image_processor(vl.model_dir)
    prompts = prompt_lengths(f"{tmp_path / 'data.parquet'}:prompt", tokenizer, images)
    # 448 / 14 = 32 patches a side, merged 2x2: 256 tokens a picture, between its start and end markers
    assert prompts[0] == prompts[1] + 3 * (256 + 2)
    verl_split = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    responses = 400
    even = lb_mini([prompts[1] + responses] * 8, 2, 8192, baseline=verl_split)
    assert rank_shares(even) == rank_shares(verl_split)
    shares = rank_shares(lb_mini([p + responses for p in prompts], 2, 8192, baseline=verl_split))
    with_heavy = next(share for share in shares if 0 in share)
    assert len(with_heavy) < 4 < len(next(share for share in shares if 0 not in share)), shares


def test_a_column_that_is_not_lengths_fails_in_one_line(verl_files, capsys):
    root, _, _ = verl_files
    data = f"{root}/train.parquet"
    for column, match in [
        (
            "prompt",
            r"train.parquet:prompt is list<element: struct<role: string, content: string>>, chat messages "
            r"\(a prompt\), not token counts; give --tokenizer MODEL_DIR",
        ),
        ("data_source", r"train.parquet:data_source is string; expected integer lengths or lists of token ids"),
        ("reward_model", r"train.parquet:reward_model is struct<style: string, ground_truth: string>; expected"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            load_lengths(f"{data}:{column}")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"train.parquet:data_source is string; --tokenizer counts a column of chat"):
        prompt_lengths(f"{data}:data_source", verl_files[2])
    with pytest.raises(SystemExit):
        planner.main(["--lengths", f"{data}:prompt", "--ranks", "2", "--minibatch-sizes", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "chat messages (a prompt), not token counts; give --tokenizer MODEL_DIR" in err[-1], err


def test_rollout_dump_lengths_are_the_tokenizers_counts(verl_files, tmp_path):
    """Rollouts dumped by verl's own writer (the v1 trainer's _write_generations, as trainer.rollout_data_dir
    runs it), the prompt and response text decoded without special tokens as verl decodes them: each
    rollout counts the tokenizer's tokens of both texts, a few short of the sequence trained on (the
    special tokens the decoding dropped, and text across them tokenized together)."""
    import json

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    _, problems, tokenizer = verl_files
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    trained = {}
    for step, batch in ((1, problems[:8]), (2, problems[8:20])):
        prompts = [
            tokenizer.apply_chat_template(
                prompt_messages(p), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for p in batch
        ]
        responses = [tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [eos] for p in batch]
        PPOTrainer._write_generations(
            tokenizer.batch_decode(prompts, skip_special_tokens=True),
            tokenizer.batch_decode(responses, skip_special_tokens=True),
            [p.answer for p in batch],
            [1.0] * len(batch),
            {"uid": [f"{i}_0_0" for i in range(len(batch))]},
            str(tmp_path),
            step,
        )
        trained[step] = [len(p) + len(r) for p, r in zip(prompts, responses)]
    read = rollout_dump_lengths(str(tmp_path), tokenizer)
    assert read == {
        step: [
            len(tokenizer(r["input"], add_special_tokens=False)["input_ids"])
            + len(tokenizer(r["output"], add_special_tokens=False)["input_ids"])
            for r in map(json.loads, (tmp_path / f"{step}.jsonl").read_text().splitlines())
        ]
        for step in trained
    }
    # 3 special tokens of the chat template and the end of sequence dropped, and a few merged across them
    assert all(4 <= t - r <= 8 for step in trained for t, r in zip(trained[step], read[step]))
    assert rollout_dump_lengths(str(tmp_path / "2.jsonl"), tokenizer) == {2: read[2]}
    source = plan_lengths(str(tmp_path), tokenizer=str(verl_files[0] / "model"))
    assert (source.steps, source.step_samples) == (2, 8)
    assert sorted(source.draw(8, 0)) == sorted(read[1]) and set(source.draw(5, 1)) <= set(read[2])
    with pytest.raises(ValueError, match="a mini-batch of 9 is more than the 8 rollouts of a step of"):
        source.draw(9, 0)
    with pytest.raises(ValueError, match="is a verl rollout dump \\(text\\); give --tokenizer MODEL_DIR"):
        plan_lengths(str(tmp_path))


def test_logged_step_lengths_model_each_step(tmp_path, monkeypatch):
    """verl's file logger output of steps whose metrics verl's own compute_data_metrics and
    compute_throughout_metrics computed: each step's drawn lengths match its logged mean, clip ratio and
    range, and a run whose responses lengthen plans longer steps."""
    import torch
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_throughout_metrics
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "run.jsonl"))
    logger = FileLogger("odc", "lengths")
    truth = {}
    for step, median_frac in ((1, 0.15), (2, 0.3), (3, 0.5)):
        sample = rl_math_like(
            1024, max_prompt_length=512, max_response_length=4096, response_median_frac=median_frac, seed=step
        )
        prompt, response = torch.tensor(sample.prompt_lens), torch.tensor(sample.response_lens)
        zeros = torch.zeros(1024, 4096)
        batch = DataProto.from_dict(
            tensors={
                "prompts": torch.zeros(1024, 512, dtype=torch.long),
                "responses": torch.zeros(1024, 4096, dtype=torch.long),
                "response_mask": (torch.arange(4096) < response[:, None]).long(),
                "prompt_length": prompt.float(),
                "response_length": response.float(),
                **dict.fromkeys(("token_level_scores", "token_level_rewards", "advantages", "returns"), zeros),
            },
            meta_info={"global_token_num": sample.total},
        )
        metrics = compute_data_metrics(batch, use_critic=False) | compute_throughout_metrics(batch, {"step": 1.0}, 1)
        logger.log(metrics, step)
        truth[step] = sample
    logger.finish()
    logged = logged_step_lengths(str(tmp_path / "run.jsonl"))
    for step, (prompts, responses) in logged.items():
        assert prompts.samples == responses.samples == 1024
        rng = np.random.default_rng(0)
        for model, true in ((prompts, truth[step].prompt_lens), (responses, truth[step].response_lens)):
            drawn = model.draw(20000, rng)
            assert drawn.mean() == pytest.approx(np.mean(true), rel=0.03)
            assert min(true) <= drawn.min() and drawn.max() <= max(true)
            assert np.mean(drawn == max(true)) == pytest.approx(np.mean(np.array(true) == max(true)), abs=0.01)
    source = plan_lengths(str(tmp_path / "run.jsonl"))
    assert (source.steps, source.step_samples) == (3, 1024)
    assert [np.mean(source.draw(512, seed)) for seed in range(3)] == sorted(
        np.mean(source.draw(512, s)) for s in range(3)
    )
