"""The text models' assets: arithmetic word problems in verl's GSM8K parquet layout, and a tiny Qwen2 or
Qwen3-MoE with its tokenizer (a chat template included), warm-started on the task.

A randomly initialised model never writes "#### <number>", so every reward is 0, every GRPO advantage
is 0 and training does nothing; a short supervised warm start teaches it the answer format and some
arithmetic, so that rewards vary within a group. Problems take 1 to 4 steps, so responses differ in
length; they come from Python's own seeded generator and are the same everywhere. The tokenizer and the
warm start serve the vision-language model too (vl_assets.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..data import GSM8K, GSM8K_INSTRUCTION, make_row

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    + IM_START
    + "{{ message['role'] }}\n{{ message['content'] }}"
    + IM_END
    + "\n{% endfor %}{% if add_generation_prompt %}"
    + IM_START
    + "assistant\n{% endif %}"
)
MODEL_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
# Every MLP a mixture of 4 experts, 2 per token; the rest as the Qwen2.
MOE_SHAPE = {
    **MODEL_SHAPE,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}
NAMES = ("Ann", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "pens", "coins", "books", "cards", "shells", "stamps", "marbles")


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked steps, then "#### <answer>"
    answer: str


def make_problem(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, 12)
    sentences, steps = [f"{name} has {value} {item}."], []
    for _ in range(rng.randint(1, 4)):
        amount = rng.randint(1, 5)
        if rng.random() < 0.5 or amount > value:
            sentences.append(f"{name} gets {amount} more.")
            steps.append(f"{value} + {amount} = {value + amount}.")
            value += amount
        else:
            sentences.append(f"{name} gives away {amount}.")
            steps.append(f"{value} - {amount} = {value - amount}.")
            value -= amount
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(sentences), " ".join(steps) + f"\n#### {value}", str(value))


def make_problems(n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def prompt_messages(problem: Problem) -> list[dict]:
    return make_row(GSM8K, problem.question, GSM8K_INSTRUCTION, problem.answer, "", 0)["prompt"]


def build_tokenizer(problems: list[Problem]):
    """Byte-level BPE trained on the problems, digits split one by one, ChatML-style chat template."""
    corpus = [f"user\n{m['content']}" for p in problems for m in prompt_messages(p)]
    corpus += [f"assistant\n{p.solution}" for p in problems]
    return tokenizer_from_corpus(corpus, (PAD, IM_START, IM_END), CHAT_TEMPLATE)


def tokenizer_from_corpus(corpus: list[str], special_tokens: tuple[str, ...], chat_template: str):
    """Byte-level BPE of 384 tokens trained on `corpus`, digits split one by one; the special tokens first,
    PAD, IM_START and IM_END among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, chat_template=chat_template)


def build_model(tokenizer, seed: int, model: str = "qwen2"):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_class, model_class, shape = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, MODEL_SHAPE),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE_SHAPE),
    }[model]
    eos, pad = tokenizer.convert_tokens_to_ids([IM_END, PAD])
    config = config_class(
        **shape,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        architectures=[model_class.__name__],
    )
    torch.manual_seed(seed)
    return model_class(config).to(torch.float32)


def text_examples(tokenizer, problems: list[Problem]) -> list[dict]:
    """Each problem's prompt and solution as token ids, with the prompt's length: the warm start's examples."""
    out = []
    for p in problems:
        prompt = tokenizer.apply_chat_template(prompt_messages(p), add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt + p.solution + IM_END, add_special_tokens=False)["input_ids"]
        out.append({"input_ids": ids, "n_prompt": len(tokenizer(prompt, add_special_tokens=False)["input_ids"])})
    return out


def warm_start(model, examples: list[dict], pad_id: int, steps: int, seed: int, batch_size: int = 32) -> float:
    """Supervised steps on prompt -> solution (loss on the response only); returns the last loss. An example
    is its `input_ids` and `n_prompt`, and a vision-language one's `pixel_values`, `image_grid_thw` and
    `mm_token_type_ids` (vl_assets.examples)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=g).tolist()]
        width = max(len(e["input_ids"]) for e in batch)
        input_ids = torch.full((batch_size, width), pad_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, e in enumerate(batch):
            ids, n_prompt = e["input_ids"], e["n_prompt"]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
            mask[row, : len(ids)] = 1
        for group in opt.param_groups:  # linear decay: ends near the best the tiny model reaches
            group["lr"] = 3e-3 * (1 - step / steps)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels, **_vision_inputs(batch, width)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def _vision_inputs(batch: list[dict], width: int) -> dict:
    """A vision-language model's: which tokens are images' (every such example has `mm_token_type_ids`), and
    the batch's images in order; nothing for a text model's."""
    if "mm_token_type_ids" not in batch[0]:
        return {}
    types = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        types[row, : len(e["mm_token_type_ids"])] = torch.tensor(e["mm_token_type_ids"])
    pictured = [e for e in batch if "pixel_values" in e]
    if not pictured:
        return {"mm_token_type_ids": types}
    return {
        "mm_token_type_ids": types,
        "pixel_values": torch.cat([e["pixel_values"] for e in pictured]),
        "image_grid_thw": torch.cat([e["image_grid_thw"] for e in pictured]),
    }


def write_parquet(problems: list[Problem], path: str, split: str) -> None:
    import pandas as pd

    rows = [make_row(GSM8K, p.question, GSM8K_INSTRUCTION, p.answer, split, i) for i, p in enumerate(problems)]
    pd.DataFrame(rows).to_parquet(path)


def split_problems(n_train: int = 512, n_val: int = 64, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """The training and validation problems; the tokenizer and the warm start see both and the training set."""
    problems = make_problems(n_train + n_val, seed)
    return problems[:n_train], problems[n_train:]


def warm_started(model: str, steps: int, seed: int):
    """The text model `model` warm-started again on this machine, and its tokenizer."""
    train, val = split_problems(seed=seed)
    tokenizer = build_tokenizer(train + val)
    built = build_model(tokenizer, seed, model)
    warm_start(built, text_examples(tokenizer, train), tokenizer.pad_token_id, steps, seed)
    return built, tokenizer
