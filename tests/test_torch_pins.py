"""ODC's FSDP2 code, its transports and the verl engine tests, under the torch and transformers that verl's
GPU stack runs: verl 0.9.1's vllm, sglang and fsdp extras pin torch 2.11.0 and transformers 5.9.0, while
the rest of the suite runs the `cpu` extra's torch 2.13.0, and `odc_plugin/fsdp/` reads FSDP2 internals
that change between torch releases (`_fsdp_internals.py`, the one place that knows).

The pins are read from verl's installed metadata. A virtual environment layered over the one the suite
runs in (a virtual environment or the base interpreter: its site directories come after the pins, their
`.pth` files processed, so an editable install of this project is seen), with those two installed in it
(torch from the registry, with the CUDA libraries it requires: ~4.6 GB, about a minute and a half; it runs
on CPU), is built once and cached in `ODC_VERL_CACHE` (~/.cache/odc-verl) under a name of the pins, the
interpreter and the packages of the environment beneath, their names and versions, not where they are: a
fresh virtual environment with the same packages, as `.ci/run` makes each run, reuses it (PINNED_VENV names
its directory instead). The tests below then run inside it, on CPU, one process.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
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


def layered_packages(dirs: list[str]) -> list[str]:
    """NAME==VERSION of each distribution installed in `dirs`, sorted: what the pinned venv's own installs
    were resolved against."""
    return sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions(path=dirs)})


def pinned_venv(pins: dict[str, str], venv: Path | None = None) -> Path:
    """The cached virtual environment with `pins` over this environment's packages (built if missing, and
    again when the pins, the interpreter or the packages beneath differ from those it was built with)."""
    layers = layered_site_dirs()
    wanted = " ".join(f"{k}=={v}" for k, v in sorted(pins.items()))
    stamp = "\n".join([wanted, os.path.realpath(sys.executable), *layered_packages(layers)])
    if venv is None:
        from odc_plugin.verl.cpu.assets import cache_root

        name = "-".join([*(f"{k}{v}" for k, v in sorted(pins.items())), hashlib.sha256(stamp.encode()).hexdigest()[:8]])
        venv = Path(os.environ.get("PINNED_VENV", Path(cache_root()) / f"venv-{name}"))
    python = venv / "bin" / "python"
    done = venv / "installed.txt"
    if done.exists() and done.read_text() == stamp:
        layer(python, layers)  # the same packages may have moved: a fresh virtual environment each CI run
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    layer(python, layers)
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


def layer(python: Path, dirs: list[str]) -> Path:
    """Layers `dirs` beneath the virtual environment's own packages, `python` being its interpreter, through a
    .pth file in its site-packages directory, which it returns."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # addsitedir, not a plain path line: it reads the layer's own .pth files (editable installs) too
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
    Path(purelib, "zz_odc_layered_env.pth").write_text("\n".join(lines) + "\n")
    return Path(purelib)


@pytest.fixture(scope="module")
def python():
    return pinned_venv(verl_gpu_pins())


def _clean_env() -> dict[str, str]:
    # not this run's xdist worker, nor its own torch's settings
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VIRTUAL_ENV"))}


# the verl of the environment the suite runs in
_VERL = importlib.util.find_spec("verl").origin


def _module_files(python: Path, *modules: str) -> list[str | None]:
    """The file each of `modules` imports from under `python` (None for one it does not find), found without
    importing them: verl takes seconds to import."""
    code = "import importlib.util as u, sys; print(*(getattr(u.find_spec(m), 'origin', None) for m in sys.argv[1:]))"
    # run from the root directory: from the checkout, `python -c` would find odc_plugin in the working directory
    proc = subprocess.run(
        [str(python), "-c", code, *modules], cwd="/", capture_output=True, text=True, env=_clean_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [None if f == "None" else f for f in proc.stdout.split()]


def test_the_venv_runs_verls_gpu_pins_on_cpu(python):
    code = "import torch, transformers, verl, odc_plugin.fsdp; print(torch.__version__, transformers.__version__)"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=_clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_version, transformers_version = proc.stdout.split()
    pins = verl_gpu_pins()
    assert torch_version.split("+")[0] == pins["torch"] and transformers_version == pins["transformers"]
    # the verl and the odc_plugin of the environment the suite runs in
    assert _module_files(python, "verl", "odc_plugin") == [_VERL, str(ROOT / "odc_plugin" / "__init__.py")]


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


def _virtual_environment(path: Path, system_site_packages: bool) -> tuple[Path, Path]:
    """A virtual environment made from this one's interpreter, with this environment's packages beneath its own
    (layered, as the pinned venv layers them) and a module only it has, odc_outer_only: its interpreter and
    site-packages directory."""
    subprocess.run(
        [sys.executable, "-m", "venv", *["--system-site-packages"] * system_site_packages, "--without-pip", str(path)],
        check=True,
    )
    python = path / "bin" / "python"
    site_packages = layer(python, layered_site_dirs())
    (site_packages / "odc_outer_only.py").write_text("")
    return python, site_packages


@pytest.mark.parametrize("system_site_packages", [False, True], ids=["isolated", "system-site-packages"])
def test_the_pinned_venv_imports_the_packages_of_the_virtual_environment_it_is_built_in(tmp_path, system_site_packages):
    """Built from inside a virtual environment, with or without the base interpreter's packages, the pinned venv
    imports that environment's packages: a module only it has, its verl and this checkout's odc_plugin; built
    again from another environment with the same packages, it is kept and imports that one's. A venv over the
    base interpreter instead (`python -m venv --system-site-packages` from inside the environment)
    fails the same check."""
    outer, site_packages = _virtual_environment(tmp_path / "outer", system_site_packages)
    code = "from pathlib import Path; from tests.test_torch_pins import pinned_venv; "
    code += f"print(pinned_venv({{}}, Path({str(tmp_path / 'pinned')!r})))"

    def build(python: Path) -> Path:
        built = subprocess.run(
            [python, "-c", code], cwd=ROOT, capture_output=True, text=True, env=_clean_env(), timeout=300
        )
        assert built.returncode == 0, built.stderr[-3000:]
        return Path(built.stdout.strip())

    pinned = build(outer)
    modules = ("odc_outer_only", "verl", "odc_plugin")
    expected = [str(site_packages / "odc_outer_only.py"), _VERL, str(ROOT / "odc_plugin" / "__init__.py")]
    assert _module_files(outer, *modules) == expected
    assert _module_files(pinned, *modules) == expected
    # the same packages elsewhere, as CI's fresh virtual environment each run: the venv is kept, layered anew
    kept = tmp_path / "pinned" / "kept"
    kept.touch()
    moved, moved_site_packages = _virtual_environment(tmp_path / "moved", system_site_packages)
    assert build(moved) == pinned and kept.exists()
    assert _module_files(pinned, "odc_outer_only") == [str(moved_site_packages / "odc_outer_only.py")]
    over_base = tmp_path / "over_base"
    subprocess.run([outer, "-m", "venv", "--system-site-packages", "--without-pip", str(over_base)], check=True)
    assert _module_files(over_base / "bin" / "python", *modules)[0] is None
