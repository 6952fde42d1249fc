"""odc-spes refuses an output path that is a file before it trains."""

from __future__ import annotations

import pytest

from odc_plugin.spes.demo import main


def test_an_output_path_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    with pytest.raises(SystemExit) as e:
        main(["--nodes", "2", "--steps", "10", "--out", str(afile)])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == f"odc-spes: error: --out {afile} is a file: name a directory (created if missing)"
    )
    assert afile.read_text() == "keep"
