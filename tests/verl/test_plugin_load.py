"""A plugin that fails to load says so: verl itself logs a failing `verl.plugins` entry point at DEBUG level
only, after which `strategy=odc` fails far from the cause ("Unknown backend: odc")."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

FAILED = (
    "odc_plugin: the verl plugin 'odc' failed to load, strategy=odc is unavailable (verl will say 'Unknown "
    "backend: odc'); other strategies are unaffected: ImportError: simulated: a broken install"
)


def test_a_plugin_that_fails_to_load_says_why_and_leaves_verl_working(tmp_path):
    # a package the entry point imports, shadowed by one that cannot be imported
    (tmp_path / "odc_patches").mkdir()
    (tmp_path / "odc_patches" / "__init__.py").write_text('raise ImportError("simulated: a broken install")\n')
    code = (
        "import verl\n"
        "from verl.workers.engine import EngineRegistry\n"
        "print(sorted(EngineRegistry._engines['language_model']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "odc_plugin" in line]
    assert len(lines) == 1 and lines[0].startswith("ERROR:") and lines[0].endswith(FAILED), lines
    engines = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert "fsdp2" in engines and "odc" not in engines
