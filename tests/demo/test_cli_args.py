"""odc-demo refuses bad input in one line naming the option, before any rank starts, leaving nothing behind."""

from __future__ import annotations

import pytest

from odc_plugin.demo.cli import main

FIT = "configs/cost_fit/Qwen2.5-7B-H100.json"


def _refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(["--ranks", "2", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize(
    "content,message",
    [("[]", "no lengths"), ("[1,", "Expecting"), ("[5, -3]", "got -3"), (None, "not found")],
)
def test_a_bad_lengths_file_is_refused_naming_it(tmp_path, capsys, content, message):
    path = tmp_path / "lengths.json"
    if content is None:
        path.mkdir()  # a directory
    else:
        path.write_text(content)
    line = _refused(capsys, ["--lengths", str(path), "--out-dir", str(tmp_path / "out")])
    assert line.startswith("odc-demo: error: --lengths: ") and str(path) in line and message in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--workload", "sft", "--max-token-len", "0"], "--max-token-len must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--slow-ranks", "0:inf"], "--slow-ranks: factor of rank 0 must be a finite number > 0, got inf"),
        (["--emulate", FIT, "--time-scale", "inf"], "--time-scale: must be a finite number > 0 or 'auto'"),
        (["--emulate", FIT, "--sweep-ranks", "0", "4"], "--sweep-ranks: every rank count must be >= 1, got 0"),
    ],
)
def test_bad_values_are_refused_naming_the_option(tmp_path, capsys, argv, message):
    assert message in _refused(capsys, [*argv, "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_output_path_that_is_a_file_is_refused(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert "--out-dir" in _refused(capsys, ["--out-dir", str(afile)])
    assert afile.read_text() == "keep"


def test_help_shows_the_default_rank_count(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "(default " in capsys.readouterr().out.split("--ranks RANKS", 2)[-1].split("--steps")[0]
