"""Sequence lengths to balance: read from files, or drawn from generators shaped like real workloads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LengthSample:
    prompt_lens: list[int]
    response_lens: list[int]

    def __post_init__(self):
        if len(self.prompt_lens) != len(self.response_lens):
            raise ValueError(f"{len(self.prompt_lens)} prompt lengths but {len(self.response_lens)} response lengths")

    @property
    def total(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lens, self.response_lens)]


# rl_math_like at the scale reasoning RL runs at: the rl case of odc-demo's sweep, and the response lengths
# odc-grpo-cpu draws for an emulated run.
RL_PROFILE = {"max_prompt_length": 512, "max_response_length": 16384}


def rl_math_like(
    num_samples: int,
    *,
    max_prompt_length: int = 512,
    max_response_length: int = 4096,
    prompt_median: float = 200,
    prompt_sigma: float = 0.35,
    response_median_frac: float = 0.3,
    response_sigma: float = 0.8,
    seed: int = 0,
) -> LengthSample:
    """Rollouts of a GRPO/DAPO math-reasoning run.

    Prompts (a problem statement plus a chat template) are lognormal around 200 tokens, so 90% fall in
    about 110-360, as in GSM8K/MATH/DAPO-Math prompts. Responses are lognormal with a long right tail
    and a median at 0.3 * max_response_length (about 1.2k tokens for the common 4k cap, within the few
    hundred to ~2k tokens typical of GRPO/DAPO math runs on Qwen2.5 models); with sigma 0.8 about 6-7%
    run into the cap and are cut there, the pile-up at max_response_length seen in such runs. That
    share grows to 10-20% as responses lengthen during training: raise response_median_frac.
    """
    _check_count(num_samples)
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(np.log(prompt_median), prompt_sigma, num_samples)
    responses = rng.lognormal(np.log(response_median_frac * max_response_length), response_sigma, num_samples)
    return LengthSample(
        prompt_lens=np.clip(np.rint(prompts), 16, max_prompt_length).astype(int).tolist(),
        response_lens=np.clip(np.rint(responses), 1, max_response_length).astype(int).tolist(),
    )


def sft_long_context_like(
    num_samples: int,
    *,
    max_length: int = 32768,
    long_fraction: float = 0.3,
    chat_median: float = 1000,
    chat_sigma: float = 0.9,
    long_min: int = 4096,
    seed: int = 0,
) -> LengthSample:
    """A long-context SFT mixture: short chats plus long documents with a question about them.

    Chats (ShareGPT/UltraChat-like) are lognormal with a median of 1k tokens, half prompt half answer.
    A long_fraction of 30% long samples (documents, code repositories, books, as mixed in by LongAlign
    or ChatQA-2-style recipes) are log-uniform between 4k and max_length, nearly all prompt, with a
    ~300-token answer. Token counts, not sample counts, are then dominated by the long samples.
    """
    _check_count(num_samples)
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 to hold a prompt and a response, got {max_length}")
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    rng = np.random.default_rng(seed)
    is_long = rng.random(num_samples) < long_fraction
    chat = np.clip(rng.lognormal(np.log(chat_median), chat_sigma, num_samples), 2, max_length)
    doc = np.exp(rng.uniform(np.log(min(long_min, max_length)), np.log(max_length), num_samples))
    total = np.rint(np.where(is_long, doc, chat)).astype(int)
    answer = np.where(is_long, rng.lognormal(np.log(300), 0.5, num_samples), total * rng.uniform(0.3, 0.7, num_samples))
    response = np.clip(np.rint(answer).astype(int), 1, total - 1)
    return LengthSample(prompt_lens=(total - response).tolist(), response_lens=response.tolist())


def load_lengths(spec: str) -> list[int]:
    """Lengths from `file.json` (a list of ints), `file.parquet:column` (ints, or token lists whose lengths
    are taken) or any other file with one int per line."""
    path, _, column = spec.rpartition(":") if ".parquet:" in spec else (spec, "", "")
    if not Path(path).is_file():
        raise ValueError(f"length file {path!r} not found")
    if column:
        values = _parquet_lengths(path, column)
    elif path.endswith(".json"):
        values = json.loads(Path(path).read_text())
        if not isinstance(values, list):
            raise ValueError(f"{path}: expected a JSON list of lengths, got {type(values).__name__}")
    else:
        values = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    values.append(int(line))
                except ValueError:
                    raise ValueError(
                        f"{path}:{n}: expected one integer length per line, got {line.strip()!r}"
                    ) from None
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{spec}: length {i} must be a non-negative integer, got {v!r}")
    if not values:
        raise ValueError(f"{spec}: no lengths")
    return values


def _parquet_lengths(path: str, column: str) -> list:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if column not in schema.names:
        raise ValueError(f"{path} has no column {column!r}; columns: {', '.join(schema.names)}")
    data = pq.read_table(path, columns=[column]).column(column)
    if pa.types.is_list(data.type) or pa.types.is_large_list(data.type):
        data = pc.list_value_length(data)
    elif not pa.types.is_integer(data.type):
        raise ValueError(f"{path}:{column} is {data.type}; expected integer lengths or lists of tokens")
    return data.to_pylist()


def _check_count(num_samples: int) -> None:
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
