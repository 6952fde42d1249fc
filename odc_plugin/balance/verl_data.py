"""What a verl user's data set and rollout dumps hold, counted in tokens as verl counts them.

A data set's prompt column (chat messages, rendered with the model's chat template as verl's RLHFDataset
renders them, each image counted as the tokens the model's processor expands it into) and the rollouts
`trainer.rollout_data_dir` dumps each step (decoded text, counted again); and the parquet reading that
lengths.py shares.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def split_spec(spec: str) -> tuple[str, str]:
    """(path, column) of `file.parquet:column`, (spec, "") of anything else."""
    return tuple(spec.rsplit(":", 1)) if ".parquet:" in spec else (spec, "")


def parquet_column(path: str, column: str):
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if column not in schema.names:
        raise ValueError(f"{path} has no column {column!r}; columns: {', '.join(schema.names)}")
    return pq.read_table(path, columns=[column]).column(column)


def is_chat(data_type) -> bool:
    """A list of {role, content} messages: the prompt column of verl's RL data sets."""
    import pyarrow as pa

    if not (pa.types.is_list(data_type) or pa.types.is_large_list(data_type)):
        return False
    item = data_type.value_type
    return pa.types.is_struct(item) and {"role", "content"} <= {item.field(i).name for i in range(item.num_fields)}


def load_tokenizer(path: str):
    """A model directory's tokenizer (transformers' AutoTokenizer, files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer in {path!r}: {str(e).splitlines()[0]}") from None


def load_image_processor(path: str):
    """A model directory's image processor, or None for a text model: the class its processor config names,
    from transformers (which falls back to its PIL implementation without torchvision, where transformers'
    Auto class refuses)."""
    import transformers

    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        file = Path(path, name)
        config = json.loads(file.read_text()) if file.is_file() else {}
        config = config.get(key, {}) if key else config
        if "image_processor_type" in config:
            kind = config["image_processor_type"]
            if not hasattr(transformers, kind):
                raise ValueError(f"{file}: image processor {kind!r} is not one of transformers'")
            return getattr(transformers, kind).from_pretrained(path, local_files_only=True)
    return None


# verl's data.image_key default, and the placeholder of geo3k's layout: each `<image>` in a message's content
# stands for the row's next image
IMAGE_COLUMN, IMAGE_PLACEHOLDER = "images", "<image>"


def prompt_lengths(spec: str, tokenizer, image_processor=None) -> list[int]:
    """Token counts of the prompts of a verl data set, `file.parquet:column` (a column of chat messages, as
    verl's data preprocessing writes `prompt`): each rendered with the tokenizer's chat template and a
    generation prompt and then tokenized without special tokens, as verl's RLHFDataset counts a prompt
    (`filter_overlong_prompts`) and its agent loop tokenizes it for the rollout.

    A data set with images (an `images` column, geo3k's layout) renders each `<image>` as the chat template
    renders an image and counts it as the tokens its processor expands the image's pad into: the patch grid
    `image_processor` gives it (`image_grid_thw`) over the merge of 2x2 patches into a token, as the Qwen-VL
    family's processors count it."""
    path, column = split_spec(spec)
    if not column or not Path(path).is_file():
        raise ValueError(f"{spec!r}: expected FILE.parquet:COLUMN of an existing file")
    data = parquet_column(path, column)
    if not is_chat(data.type):
        raise ValueError(f"{path}:{column} is {data.type}; --tokenizer counts a column of chat messages")
    prompts = data.to_pylist()
    images = _row_images(path, len(prompts))
    if any(images) and image_processor is None:
        raise ValueError(
            f"{path} has images (column {IMAGE_COLUMN!r}) and --tokenizer's model folder no image processor to "
            "count their tokens with; give the vision-language model's folder"
        )
    texts = [
        tokenizer.apply_chat_template(_with_images(messages), add_generation_prompt=True, tokenize=False)
        for messages in prompts
    ]
    return [
        n + sum(_image_tokens(image_processor, image) - 1 for image in row)  # the pad the template rendered
        for n, row in zip(token_counts(texts, tokenizer), images)
    ]


def _row_images(path: str, rows: int) -> list[list]:
    """Each row's images (as datasets stores them: dicts of encoded bytes), none where the set has no column."""
    import pyarrow.parquet as pq

    if IMAGE_COLUMN not in pq.read_schema(path).names:
        return [[] for _ in range(rows)]
    return [row or [] for row in parquet_column(path, IMAGE_COLUMN).to_pylist()]


def _with_images(messages: list[dict]) -> list[dict]:
    """Messages whose `<image>` placeholders are image items of a content list, as verl's RLHFDataset hands
    them to the chat template."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts = content.split(IMAGE_PLACEHOLDER)
            items = [{"type": "text", "text": parts[0]}] if parts[0] else []
            for part in parts[1:]:
                items += [{"type": "image"}] + ([{"type": "text", "text": part}] if part else [])
            message = {**message, "content": items}
        out.append(message)
    return out


def _image_tokens(image_processor, image: dict) -> int:
    import io

    from PIL import Image

    encoded = image.get("bytes") if isinstance(image, dict) else None
    if encoded is None:
        raise ValueError(
            f"an image of the data set is {type(image).__name__} without encoded bytes; expected datasets' layout"
        )
    grid = image_processor(images=[Image.open(io.BytesIO(encoded)).convert("RGB")], return_tensors="np").get(
        "image_grid_thw"
    )
    if grid is None:
        raise ValueError(
            f"{type(image_processor).__name__} gives no image_grid_thw: odc-plan counts the images of the "
            "Qwen-VL family's processors"
        )
    return int(np.prod(grid[0])) // getattr(image_processor, "merge_size", 2) ** 2


def token_counts(texts: Sequence[str], tokenizer) -> list[int]:
    """Tokens of each text, without the special tokens a tokenizer adds around a whole input."""
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def rollout_dump_lengths(path: str, tokenizer) -> dict[int, list[int]]:
    """Per training step, each rollout's prompt + response tokens from what verl dumps with
    `trainer.rollout_data_dir` (a directory of `<step>.jsonl`, or one such file): one JSON line per rollout,
    its prompt (`input`) and response (`output`) decoded without special tokens. Counted again with the
    tokenizer, so each rollout is short of the special tokens the decoding dropped (the chat template's
    markers, the end of sequence): a few tokens out of hundreds."""
    root = Path(path)
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    files = [f for f in files if f.stem.isdigit()]
    if not files:
        raise ValueError(f"{path}: no <step>.jsonl files of a verl rollout dump (trainer.rollout_data_dir)")
    steps = {}
    for file in sorted(files, key=lambda f: int(f.stem)):
        inputs, outputs = [], []
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                inputs.append(str(record["input"]))
                outputs.append(str(record["output"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f"{file}:{number}: not a verl rollout dump line (JSON with input and output)"
                ) from None
        if inputs:
            counts = token_counts(inputs + outputs, tokenizer)
            steps[int(file.stem)] = [p + r for p, r in zip(counts[: len(inputs)], counts[len(inputs) :])]
    if not steps:
        raise ValueError(f"{path}: the rollout dump holds no rollouts")
    return steps
