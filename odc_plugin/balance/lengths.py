"""Sequence lengths to balance: read from files, or drawn from generators shaped like real workloads.

What a verl user has is read as verl writes it: a data set's prompt column and the rollouts
`trainer.rollout_data_dir` dumps each step (counted in tokens by verl_data.py), and the `response_length/*`
and `prompt_length/*` statistics verl's `file` logger writes each step. `plan_lengths` turns any of them
into the planner's `LengthSource`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from odc_plugin.balance.verl_data import (
    is_chat,
    load_image_processor,
    load_tokenizer,
    parquet_column,
    prompt_lengths,
    rollout_dump_lengths,
    split_spec,
)


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
    return _rounded(prompts, responses, max_prompt_length, max_response_length)


def _rounded(prompts, responses, max_prompt_length: int, max_response_length: int) -> LengthSample:
    """Drawn lengths as whole tokens, prompts at least 16 and responses at least 1, each cut at its cap."""
    return LengthSample(
        prompt_lens=np.clip(np.rint(prompts), 16, max_prompt_length).astype(int).tolist(),
        response_lens=np.clip(np.rint(responses), 1, max_response_length).astype(int).tolist(),
    )


def agent_like(
    num_samples: int,
    *,
    max_prompt_length: int = 2048,
    max_response_length: int = 16384,
    max_turns: int = 8,
    mean_turns: float = 3.0,
    turn_median: float = 600,
    observation_median: float = 300,
    sigma: float = 0.9,
    seed: int = 0,
) -> LengthSample:
    """Trajectories of a multi-turn, tool-using agent loop (verl's agent loop with a tool, as verl-recipe's
    ReTool recipe runs it: prompts up to 2k tokens, trajectories up to 16k, a few assistant turns each).

    A trajectory has 1 + a geometric number of turns (mean `mean_turns`, at most `max_turns`); each turn is
    the model's tokens (lognormal around `turn_median`) and, but the last, a tool observation (lognormal
    around `observation_median`), which the loss masks out but the passes still compute. Its response is
    all of them, cut at max_response_length. The tail is longer than a single-turn one's: most end in a
    turn or two, some run to the cap. Modelled, not fitted to a run; prompts as rl_math_like's.
    """
    _check_count(num_samples)
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(np.log(200), 0.35, num_samples)
    turns = np.minimum(rng.geometric(1 / mean_turns, num_samples), max_turns)
    responses = [
        rng.lognormal(np.log(turn_median), sigma, t).sum()
        + rng.lognormal(np.log(observation_median), sigma, t - 1).sum()
        for t in turns
    ]
    return _rounded(prompts, responses, max_prompt_length, max_response_length)


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
    path, column = split_spec(spec)
    if not Path(path).is_file():
        raise ValueError(f"length file {path!r} not found")
    if column:
        values = _parquet_lengths(path, column)
    elif path.endswith(".json"):
        try:
            values = json.loads(_read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e}); expected a JSON list of lengths") from None
        if not isinstance(values, list):
            raise ValueError(f"{path}: expected a JSON list of lengths, got {type(values).__name__}")
    else:
        values = []
        for n, line in enumerate(_read_text(path).splitlines(), 1):
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
    if not any(values):
        raise ValueError(f"{spec}: every length is 0, nothing to balance; give the file of the real lengths")
    return values


def _read_text(path: str) -> str:
    """A lengths file's text; a parquet file (read only by column) or any other binary file is refused."""
    with open(path, "rb") as fp:
        data = fp.read()
    if data[:4] == b"PAR1":
        raise ValueError(f"{path} looks like a parquet file; pass {path}:COLUMN, the column of lengths or token ids")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected lengths") from None


def _parquet_lengths(path: str, column: str) -> list:
    import pyarrow as pa
    import pyarrow.compute as pc

    data = parquet_column(path, column)
    if is_chat(data.type):
        raise ValueError(
            f"{path}:{column} is {data.type}, chat messages (a prompt), not token counts; give --tokenizer MODEL_DIR "
            "to count its tokens with the model's chat template"
        )
    if pa.types.is_list(data.type) or pa.types.is_large_list(data.type):
        if not pa.types.is_integer(data.type.value_type):
            raise ValueError(f"{path}:{column} is {data.type}; expected integer lengths or lists of token ids")
        data = pc.list_value_length(data)
    elif not pa.types.is_integer(data.type):
        raise ValueError(f"{path}:{column} is {data.type}; expected integer lengths or lists of token ids")
    return data.to_pylist()


@dataclass(frozen=True)
class LoggedLengths:
    """The length statistics verl logs per step for prompts or responses (`<name>/mean`, `/max`, `/min`,
    `/clip_ratio`: the share at the maximum length), modelled as a lognormal clipped to [min, max].

    With a clip ratio c in (0, 1) the maximum is the cap: the fit puts c of the mass at or above it and
    matches the clipped mean. With none clipped, the largest of `samples` draws is taken to be the
    1 - 1/(samples + 1) quantile, and the mean is matched.
    """

    mean: float
    max: float
    min: float
    clip_ratio: float
    samples: int

    def sigma_mu(self) -> tuple[float, float]:
        """The lognormal's (sigma, mu); sigma 0 when every value is the same."""
        if self.max <= self.min or self.mean >= self.max or self.clip_ratio >= 1:
            return 0.0, math.log(max(self.max, 1.0))
        cap = math.log(self.max)
        if self.clip_ratio > 0:
            z = NormalDist().inv_cdf(1 - self.clip_ratio)
            # E[min(X, max)] / max = exp(s^2/2 - s z) Phi(z - s) + clip_ratio, decreasing in s from 1 to clip_ratio
            target = self.mean / self.max - self.clip_ratio
            lo, hi = 1e-6, 10.0
            for _ in range(100):
                s = (lo + hi) / 2
                lo, hi = (s, hi) if math.exp(s * s / 2 - s * z) * NormalDist().cdf(z - s) > target else (lo, s)
            sigma = (lo + hi) / 2
        else:
            z = NormalDist().inv_cdf(1 - 1 / (self.samples + 1))
            # exp(mu + s^2/2) = mean with mu = ln(max) - s z: the smaller root of s^2/2 - s z + ln(max/mean) = 0
            sigma = z - math.sqrt(max(z * z - 2 * math.log(self.max / max(self.mean, 1.0)), 0.0))
        return sigma, cap - sigma * z

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        sigma, mu = self.sigma_mu()
        values = np.exp(mu + sigma * rng.standard_normal(n))
        return np.clip(np.rint(values), max(self.min, 0), self.max).astype(int)


def read_metrics(path: str) -> dict[int, dict[str, float]]:
    """All records of a `file` logger output, merged per step (a step may be logged more than once)."""
    steps: dict[int, dict[str, float]] = {}
    try:
        with open(path, encoding="utf-8") as fp:
            for number, line in enumerate(fp, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    step, data = int(record["step"]), record["data"]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{number}: not a verl file-logger record ({e})") from None
                if not isinstance(data, dict):
                    raise ValueError(
                        f"{path}:{number}: not a verl file-logger record (data is a {type(data).__name__}, "
                        "not an object of metrics)"
                    )
                merged = steps.setdefault(step, {})
                for key, value in data.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                        merged[key] = float(value)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such metrics file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a directory, not a metrics file (verl's file logger, .jsonl)") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}), not a metrics file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the metrics file ({e.strerror})") from None
    return steps


def logged_step_lengths(path: str) -> dict[int, tuple[LoggedLengths, LoggedLengths]]:
    """Per training step, (prompt, response) length statistics from verl's `file` logger output
    (`trainer.logger=[...,file]`: one JSON line {"step", "data"} per step). A step's sample count is its
    `perf/total_num_tokens` over its mean prompt + response length."""
    records = read_metrics(path)
    steps = {}
    for step, data in records.items():
        keys = [f"{name}/{stat}" for name in ("prompt_length", "response_length") for stat in ("mean", "max", "min")]
        if not all(k in data for k in keys):
            continue  # a record without the trainer's batch metrics (e.g. a validation-only line)
        per_sample = data["prompt_length/mean"] + data["response_length/mean"]
        samples = round(data.get("perf/total_num_tokens", 0) / per_sample) if per_sample else 0
        steps[step] = tuple(
            LoggedLengths(
                data[f"{name}/mean"],
                data[f"{name}/max"],
                data[f"{name}/min"],
                data.get(f"{name}/clip_ratio", 0.0),
                max(samples, 2),  # the quantile of the largest of one draw would be the median
            )
            for name in ("prompt_length", "response_length")
        )
    if not steps:
        raise ValueError(f"{path}: no step with verl's prompt_length/* and response_length/* metrics")
    return steps


@dataclass(frozen=True)
class LengthSource:
    """Sequence lengths (prompt + response) to plan with: `draw(n, seed)` gives one mini-batch of n.

    For a run (`steps` > 0) the seed picks the step, in the run's order, and the mini-batch is n of that
    step's sequences; `step_samples` is the smallest step's sequence count (estimated from the tokens when
    the run logged statistics, of which any n can be drawn; a dumped step holds only its own rollouts)."""

    draw: Callable[[int, int], list[int]]
    longest: int
    what: str
    steps: int = 0
    step_samples: int | None = None


def plan_lengths(
    spec: str,
    *,
    tokenizer: str | None = None,
    max_prompt_length: int = 512,
    max_response_length: int = 4096,
    max_length: int = 32768,
) -> LengthSource:
    """The lengths `odc-plan --lengths` names: `rl` or `sft` (the generators above), a verl data set's chat
    column `FILE.parquet:prompt` with a tokenizer (its prompts, each with a response drawn as `rl` draws
    them), a rollout dump directory or file (needs the tokenizer), verl's `file` logger output, or a file
    of lengths (load_lengths, sampled with replacement).

    Long because it is one branch per kind of input, each a few lines."""
    if spec == "rl":

        def draw(n, seed):
            return rl_math_like(
                n, max_prompt_length=max_prompt_length, max_response_length=max_response_length, seed=seed
            ).total

        return LengthSource(
            draw,
            max_prompt_length + max_response_length,
            f"rl profile (prompts up to {max_prompt_length}, responses up to {max_response_length} tokens)",
        )
    if spec == "agent":
        return LengthSource(
            lambda n, seed: (
                agent_like(
                    n, max_prompt_length=max_prompt_length, max_response_length=max_response_length, seed=seed
                ).total
            ),
            max_prompt_length + max_response_length,
            f"agent profile (multi-turn trajectories: prompts up to {max_prompt_length}, responses up to "
            f"{max_response_length} tokens)",
        )
    if spec == "sft":
        return LengthSource(
            lambda n, seed: sft_long_context_like(n, max_length=max_length, seed=seed).total,
            max_length,
            f"sft profile (up to {max_length} tokens)",
        )
    path, column = split_spec(spec)
    if column and tokenizer:
        prompts = np.asarray(prompt_lengths(spec, load_tokenizer(tokenizer), load_image_processor(tokenizer)))

        def draw(n, seed):
            responses = rl_math_like(n, max_response_length=max_response_length, seed=seed).response_lens
            return (np.random.default_rng(seed).choice(prompts, n) + responses).tolist()

        return LengthSource(
            draw,
            int(prompts.max()) + max_response_length,
            f"{len(prompts)} prompts of {spec} (chat template of {tokenizer}) + rl-profile responses up to "
            f"{max_response_length} tokens",
        )
    keys = _first_record_keys(path)
    if Path(path).is_dir() or keys >= {"input", "output"}:
        if not tokenizer:
            raise ValueError(f"{path} is a verl rollout dump (text); give --tokenizer MODEL_DIR to count its tokens")
        steps = list(rollout_dump_lengths(path, load_tokenizer(tokenizer)).values())

        def draw(n, seed):
            step = steps[seed % len(steps)]
            if n > len(step):
                raise ValueError(f"a mini-batch of {n} is more than the {len(step)} rollouts of a step of {path}")
            return np.random.default_rng(seed).choice(step, n, replace=False).tolist()

        return LengthSource(
            draw,
            max(max(step) for step in steps),
            f"{len(steps)} steps of rollouts verl dumped in {path} (tokens counted with {tokenizer})",
            steps=len(steps),
            step_samples=min(len(step) for step in steps),
        )
    if keys >= {"step", "data"}:
        logged = list(logged_step_lengths(path).values())

        def draw(n, seed):
            rng = np.random.default_rng(seed)
            prompt, response = logged[seed % len(logged)]
            return (prompt.draw(n, rng) + response.draw(n, rng)).tolist()

        return LengthSource(
            draw,
            int(max(p.max + r.max for p, r in logged)),
            f"{len(logged)} steps of {path} (verl's file logger): lognormal prompt and response lengths fitted "
            "to each step's logged mean, max, min and clip ratio",
            steps=len(logged),
            step_samples=min(p.samples for p, _ in logged),
        )
    lengths = np.asarray(load_lengths(spec))
    return LengthSource(
        lambda n, seed: np.random.default_rng(seed).choice(lengths, n).tolist(),
        int(lengths.max()),
        f"{len(lengths)} lengths of {spec}",
    )


def _first_record_keys(path: str) -> set[str]:
    """The keys of a JSON-lines file's first record (empty for anything else)."""
    if not path.endswith(".jsonl") or not Path(path).is_file():
        return set()
    with open(path, encoding="utf-8") as fp:
        try:
            for line in fp:
                if line.strip():
                    record = json.loads(line)
                    return set(record) if isinstance(record, dict) else set()
        except ValueError:  # not JSON, or not UTF-8: load_lengths says which
            return set()
    return set()


def _check_count(num_samples: int) -> None:
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
