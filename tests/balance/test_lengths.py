"""Length generators and loaders."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from odc_plugin.balance import LengthSample, load_lengths, rl_math_like, sft_long_context_like


def test_rl_math_like_shape():
    s = rl_math_like(20000, max_prompt_length=512, max_response_length=4096, seed=1)
    prompts, responses = np.array(s.prompt_lens), np.array(s.response_lens)
    assert s.total == (prompts + responses).tolist()
    assert prompts.min() >= 16 and prompts.max() <= 512 and responses.min() >= 1
    assert 100 <= np.percentile(prompts, 5) and np.percentile(prompts, 95) <= 400
    assert 500 <= np.median(responses) <= 2000
    assert 0.03 <= np.mean(responses == 4096) <= 0.2  # the pile-up of truncated responses
    assert rl_math_like(50, seed=3) == rl_math_like(50, seed=3) != rl_math_like(50, seed=4)


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
        (None, None, "a.parquet:s", r"a.parquet:s is string; expected integer lengths or lists of tokens"),
    ],
)
def test_load_lengths_errors(tmp_path, name, content, spec, match):
    pq.write_table(pa.table({"n": [1], "s": ["a"]}), tmp_path / "a.parquet")
    if name:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match):
        load_lengths(str(tmp_path / spec))
