"""ODC's FSDP2 code, its transports and the verl engine tests, under the torch and transformers that verl's
GPU stack runs: verl 0.9.1's vllm, sglang and fsdp extras pin torch 2.11.0 and transformers 5.9.0, while
the rest of the suite runs the `cpu` extra's torch 2.13.0, and `odc_plugin/fsdp/` reads FSDP2 internals
that change between torch releases (`_fsdp_internals.py`, the one place that knows).

The pins are read from verl's installed metadata. A virtual environment layered over the one the suite
runs in (a virtual environment or the base interpreter: its site directories come after the pins, their
`.pth` files processed, so an editable install of this project is seen), with those two installed in it
(torch from the registry, with the CUDA libraries it requires: ~4.6 GB, about a minute and a half; it runs
on CPU), is built once per environment and cached under a name of the pins and the environment
(PINNED_VENV names its directory instead); the tests below then run inside it, on CPU, one process.
"""

from __future__ import annotations

import hashlib
import os
import site
import subprocess
import sys
import sysconfig
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


def layered_site_dirs() -> list[str]:
    """The running environment's site directories, in the order it reads them: what the pinned venv layers
    beneath its pins (`--system-site-packages` would give the base interpreter's, not a virtual
    environment's)."""
    dirs = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(os.path.realpath(d) for d in dirs) if os.path.isdir(d)]


def pinned_venv(pins: dict[str, str], venv: Path | None = None) -> Path:
    """The cached virtual environment with `pins` over this environment's packages (built if missing, and
    again when the pins or the environment beneath differ from those it was built with)."""
    layers = layered_site_dirs()
    wanted = " ".join(f"{k}=={v}" for k, v in sorted(pins.items()))
    stamp = "\n".join([wanted, os.path.realpath(sys.executable), *layers])
    if venv is None:
        name = "-".join([*(f"{k}{v}" for k, v in sorted(pins.items())), hashlib.sha256(stamp.encode()).hexdigest()[:8]])
        venv = Path(os.environ.get("PINNED_VENV", Path.home() / ".cache" / "odc-verl" / f"venv-{name}"))
    python = venv / "bin" / "python"
    done = venv / "installed.txt"
    if done.exists() and done.read_text() == stamp:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # addsitedir, not a plain path line: it reads the layer's own .pth files (editable installs) too
    lines = [f"import site; site.addsitedir({d!r})" for d in layers]
    Path(purelib, "zz_odc_layered_env.pth").write_text("\n".join(lines) + "\n")
    if pins:
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *wanted.split()],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        if install.returncode != 0:
            pytest.fail(f"could not install {wanted} into {venv}: {install.stderr.strip().splitlines()[-1:]}")
    done.write_text(stamp)
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


def test_the_pinned_venv_layers_over_the_virtual_environment_the_suite_runs_in(tmp_path):
    """Built from inside a virtual environment, the pinned venv sees that environment's packages (here a
    module only it has, verl and this project's editable install), not only the base interpreter's."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(outer)], check=True)
    outer_python = outer / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    outer_site = subprocess.run([outer_python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    Path(outer_site, "odc_outer_only.py").write_text("")
    code = "import sys; from pathlib import Path; from tests.test_torch_pins import pinned_venv; "
    code += f"print(pinned_venv({{}}, Path({str(tmp_path / 'pinned')!r})))"
    env = _clean_env()
    built = subprocess.run([outer_python, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    code = "import odc_outer_only, verl, odc_plugin; print(odc_outer_only.__file__); print(odc_plugin.__file__)"
    proc = subprocess.run([built.stdout.strip(), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker, plugin = proc.stdout.split()
    assert Path(marker).parent == Path(outer_site).resolve() and Path(plugin).is_relative_to(ROOT)
