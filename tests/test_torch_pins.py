"""ODC's FSDP2 code, its transports and the verl engine tests, under the torch and transformers that verl's
GPU stack runs: verl 0.9.1's vllm, sglang and fsdp extras pin torch 2.11.0 and transformers 5.9.0, while
the rest of the suite runs the `cpu` extra's torch 2.13.0, and `odc_plugin/fsdp/` reads FSDP2 internals
that change between torch releases (`_fsdp_internals.py`, the one place that knows).

The pins are read from verl's installed metadata. A virtual environment over this one's packages, with
those two installed in it (torch from the registry, with the CUDA libraries it requires: ~4.6 GB, about a
minute and a half; it runs on CPU), is built once per machine and cached (PINNED_VENV names its
directory); the tests below then run inside it, on CPU, one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_install import exact_versions, verl_requirements

ROOT = Path(__file__).resolve().parents[1]
# the FSDP2 and transport tests, and the engine-level verl tests: verl's TrainingWorker and the odc engines
# on gloo ranks, no trainer runs
SUBSET = (
    "tests/fsdp",
    "tests/comm",
    "tests/verl/test_odc_*.py",
    "tests/verl/test_*engine*.py",
    "tests/verl/test_harness_fsdp2.py",
    "tests/verl/test_lb_mini_dispatch.py",
)
# left out, and why
LEFT_OUT = {
    "tests/verl/test_odc_ulysses_engine.py": "Ulysses' all-to-alls on CPU need gloo's alltoall, which torch 2.11 "
    "does not have (on GPUs NCCL does)",
}
PINNED = ("torch", "transformers")
INSTALL_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 1800


def verl_gpu_pins() -> dict[str, str]:
    """{package: version} that verl's vllm extra pins exactly, for PINNED."""
    pins = {}
    for req in verl_requirements("vllm"):
        exact = exact_versions(req)
        if req.name in PINNED and exact:
            pins[req.name] = exact[0]
    assert sorted(pins) == sorted(PINNED), pins
    return pins


def pinned_venv(pins: dict[str, str]) -> Path:
    """The cached virtual environment with `pins` over this environment's packages (built if missing)."""
    name = "-".join(f"{k}{v}" for k, v in sorted(pins.items()))
    default = Path.home() / ".cache" / "odc-verl" / f"venv-{name}"
    venv = Path(os.environ.get("PINNED_VENV", default))
    python = venv / "bin" / "python"
    done = venv / "installed.txt"
    wanted = " ".join(f"{k}=={v}" for k, v in sorted(pins.items()))
    if done.exists() and done.read_text() == wanted:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv)], check=True)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *wanted.split()],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    if install.returncode != 0:
        pytest.fail(f"could not install {wanted} into {venv}: {install.stderr.strip().splitlines()[-1:]}")
    done.write_text(wanted)
    return python


@pytest.fixture(scope="module")
def python():
    return pinned_venv(verl_gpu_pins())


def _clean_env() -> dict[str, str]:
    # not this run's xdist worker, nor its own torch's settings
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VIRTUAL_ENV"))}


def test_the_venv_runs_verls_gpu_pins_on_cpu(python):
    code = "import torch, transformers, verl, odc_plugin.fsdp; print(torch.__version__, transformers.__version__)"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=_clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_version, transformers_version = proc.stdout.split()
    pins = verl_gpu_pins()
    assert torch_version.split("+")[0] == pins["torch"] and transformers_version == pins["transformers"]


def _subset() -> list[str]:
    paths = sorted({str(p.relative_to(ROOT)) for pattern in SUBSET for p in ROOT.glob(pattern)})
    assert paths and all(p in paths for p in LEFT_OUT), paths
    return [p for p in paths if p not in LEFT_OUT]


def test_fsdp_comm_and_engine_tests_pass_under_verls_gpu_pins(python):
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-o", "addopts=-ra", "-p", "no:cacheprovider", *_subset()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=RUN_TIMEOUT_S,
    )
    summary = proc.stdout.strip().splitlines()[-1:]
    print(f"under {verl_gpu_pins()}: {summary}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
