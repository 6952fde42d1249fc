"""The vision-language assets of verl's VL GRPO job on a laptop: a tiny Qwen2.5-VL, its processor and a data
set of pictures in verl's geo3k layout, all made offline.

The model is transformers' Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a vision tower of two blocks
(window attention, then full attention), the patch merger, and the multi-axis rope, with the tiny text
model's decoder (text_assets.MODEL_SHAPE). Its processor is Qwen2.5-VL's image processor and image tokens behind
a chat template that renders an image as Qwen2.5-VL's does (`<|vision_start|><|image_pad|><|vision_end|>`),
so that verl's dataset and agent loop build prompts with image tokens as for the real model; vl_processor.py
says why it has no video processor.

The data set is geo3k's layout (an `images` column, each `<image>` of the user's content standing for the
next one) with questions a rule checks: how many squares a picture shows, or how many several show in
all, beside the text model's word problems, so that samples carry no image, one, or two or three. Each
picture is 56x56 pixels, a 2x2 grid of 28x28 cells with a square of some colour in 1 to 4 of them: one
image token per cell (Qwen2.5-VL merges 2x2 patches of 14 pixels), the smallest image Qwen2.5-VL's resizing
keeps as it is. Answers end in "#### <count>" and are scored by verl's GSM8K rule (geo3k's own scorer
needs `mathruler`, which verl does not install).

Like the text models, the model is shipped warm-started (assets.py says why): the warm start teaches it the
answer's format and some counting, so that rewards vary within a group.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import torch

from ..data import GSM8K, GSM8K_INSTRUCTION, make_row
from .text_assets import IM_END, IM_START, MODEL_SHAPE, PAD, make_problem, tokenizer_from_corpus, warm_start

IMAGE, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<image>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2-VL's template, without its default system message (as the text models' has none): a message's content
# is a string, or a list of images and texts
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    + IM_START
    + "{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    + "{% else %}{% for content in message['content'] %}"
    + "{% if content['type'] == 'image' or 'image' in content %}"
    + VISION_START
    + IMAGE_PAD
    + VISION_END
    + "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    + IM_END
    + "\n{% endfor %}{% if add_generation_prompt %}"
    + IM_START
    + "assistant\n{% endif %}"
)
# Qwen2.5-VL's vision tower at the text model's width: 14-pixel patches, 2 frames a patch, 2x2 patches merged
# into one token of the decoder's width
VISION_SHAPE = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": MODEL_SHAPE["hidden_size"],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [1],
}
# the decoder's rope over (time, height, width) of its head's 8 frequency pairs, as Qwen2.5-VL's [16, 24, 24]
# splits 64
MROPE_SECTION = [2, 3, 3]
CELL, GRID = 28, 2  # a picture: GRID x GRID cells of CELL pixels
COLOURS = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 170, 20), (150, 60, 180))


@dataclass(frozen=True)
class VLProblem:
    question: str  # an "<image>" for each picture, in order
    solution: str
    answer: str
    images: tuple[bytes, ...] = ()  # PNG files


def picture(rng: random.Random, squares: int) -> bytes:
    """A white picture with a coloured square in `squares` of its cells, as a PNG file."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CELL * GRID, CELL * GRID), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(GRID * GRID), squares):
        size = rng.randint(12, 22)
        x = cell % GRID * CELL + rng.randint(0, CELL - size)
        y = cell // GRID * CELL + rng.randint(0, CELL - size)
        draw.rectangle([x, y, x + size - 1, y + size - 1], fill=rng.choice(COLOURS))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_vl_problem(rng: random.Random, images: int) -> VLProblem:
    """A problem with `images` pictures: none is the text model's word problem."""
    if images == 0:
        text = make_problem(rng)
        return VLProblem(text.question, text.solution, text.answer)
    counts = [rng.randint(1, GRID * GRID) for _ in range(images)]
    pictures = tuple(picture(rng, n) for n in counts)
    total = sum(counts)
    if images == 1:
        question, solution = IMAGE + "How many squares are in the picture?", f"{total} squares.\n#### {total}"
        return VLProblem(question, solution, str(total), pictures)
    steps = " + ".join(map(str, counts)) + f" = {total}."
    question = IMAGE * images + "How many squares are in the pictures in all?"
    return VLProblem(question, f"{steps}\n#### {total}", str(total), pictures)


def make_vl_problems(n: int, seed: int) -> list[VLProblem]:
    """No picture, one, and two or three, in turn."""
    rng = random.Random(seed)
    return [make_vl_problem(rng, (0, 1, rng.randint(2, 3))[i % 3]) for i in range(n)]


def split_problems(n_train: int = 512, n_val: int = 64, seed: int = 0) -> tuple[list[VLProblem], list[VLProblem]]:
    problems = make_vl_problems(n_train + n_val, seed)
    return problems[:n_train], problems[n_train:]


def make_vl_row(problem: VLProblem, split: str, index: int) -> dict:
    """A row of verl's geo3k layout: the images as the `datasets` library stores them ({bytes, path})."""
    row = make_row(GSM8K, problem.question, GSM8K_INSTRUCTION, problem.answer, split, index)
    return {**row, "images": [{"bytes": png, "path": None} for png in problem.images]}


def write_parquet(problems: list[VLProblem], path: str, split: str) -> None:
    import pandas as pd

    pd.DataFrame([make_vl_row(p, split, i) for i, p in enumerate(problems)]).to_parquet(path)


def messages(problem: VLProblem) -> list[dict]:
    """The user's message as verl's dataset makes it of a row: its images and texts in order."""
    from PIL import Image

    content = make_vl_row(problem, "", 0)["prompt"][0]["content"]
    if not problem.images:
        return [{"role": "user", "content": content}]
    first, *after = content.split(IMAGE)
    parts = [{"type": "text", "text": first}] if first else []
    for png, text in zip(problem.images, after):
        parts.append({"type": "image", "image": Image.open(io.BytesIO(png)).convert("RGB")})
        parts += [{"type": "text", "text": text}] if text else []
    return [{"role": "user", "content": parts}]


def build_processor(problems: list[VLProblem]):
    """Qwen2.5-VL's image processor (its defaults: 14-pixel patches, 2x2 merged, at least 56x56 pixels) and a
    tokenizer trained on the problems, with Qwen2.5-VL's vision tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .vl_processor import Qwen2_5_VLProcessor

    corpus = [f"user\n{make_vl_row(p, '', 0)['prompt'][0]['content'].replace(IMAGE, '')}" for p in problems]
    corpus += [f"assistant\n{p.solution}" for p in problems]
    tokenizer = tokenizer_from_corpus(
        corpus, (PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD), CHAT_TEMPLATE
    )
    Qwen2_5_VLProcessor.register_for_auto_class("AutoProcessor")  # saved with the class's file: remote code
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )


def build_vl_model(processor, seed: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = processor.tokenizer
    eos, pad, image, video, start, end = tokenizer.convert_tokens_to_ids(
        [IM_END, PAD, IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END]
    )
    text = {
        **MODEL_SHAPE,
        "vocab_size": len(tokenizer),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION},
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=VISION_SHAPE,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=pad,
        architectures=[Qwen2_5_VLForConditionalGeneration.__name__],
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)


def examples(processor, problems: list[VLProblem]) -> list[dict]:
    """Each problem's prompt and solution as the processor makes them (image tokens expanded, pixel values),
    with the prompt's length: the warm start's examples."""
    out = []
    for p in problems:
        chat = messages(p)
        prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        content = chat[0]["content"]
        images = [part["image"] for part in content if part["type"] == "image"] if p.images else None
        full = processor(text=[prompt + p.solution + IM_END], images=images, return_tensors="pt")
        n_prompt = processor(text=[prompt], images=images, return_tensors="pt")["input_ids"].shape[1]
        example = {
            "input_ids": full["input_ids"][0].tolist(),
            "n_prompt": n_prompt,
            "mm_token_type_ids": full["mm_token_type_ids"][0].tolist(),
        }
        if images:
            example.update(pixel_values=full["pixel_values"], image_grid_thw=full["image_grid_thw"])
        out.append(example)
    return out


def warm_started(steps: int, seed: int):
    """The model warm-started again on this machine, and its processor."""
    train, val = split_problems(seed=seed)
    processor = build_processor(train + val)
    model = build_vl_model(processor, seed)
    warm_start(model, examples(processor, train), processor.tokenizer.pad_token_id, steps, seed)
    return model, processor
