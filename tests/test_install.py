"""The plugin installs next to verl's GPU stack (README's GPU command): its requirements and its `gpu`
and `test` extras admit every version that verl 0.9.1's `vllm`, `sglang` and `fsdp` extras pin, and what
they pin themselves is within verl's ranges; the versions are read from verl's installed metadata and
compared with packaging's specifiers (no GPU wheel is downloaded). The `cpu` extra is the laptop's and
CI's torch, which is not installed beside verl's GPU extras.
"""

from __future__ import annotations

from importlib.metadata import requires
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
VERL_GPU_EXTRAS = ("vllm", "sglang", "fsdp")
BESIDE_VERL = ("gpu", "test")


def verl_requirements(extra: str, seen: frozenset = frozenset()) -> list[Requirement]:
    """What `pip install verl[extra]` asks for, with the extras it names (verl[verl-core], ...) expanded."""
    found = []
    for line in requires("verl") or ():
        req = Requirement(line)
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        if canonicalize_name(req.name) == "verl":
            found += [r for e in sorted(req.extras - seen) for r in verl_requirements(e, seen | {extra})]
        else:
            found.append(req)
    return found


def project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [line for e in extras for line in project["optional-dependencies"][e]]
    return [Requirement(line) for line in lines]


def exact_versions(req: Requirement) -> list[str]:
    """The versions `req` pins with `==`."""
    return [spec.version for spec in req.specifier if spec.operator == "=="]


def conflicts(ours: list[Requirement], theirs: list[Requirement]) -> list[str]:
    """Each exact version one side pins that the other side's specifier for the same package excludes."""
    found = []
    for a_side, b_side, a_name in ((theirs, ours, "verl"), (ours, theirs, "odc-verl")):
        for a in a_side:
            for b in b_side:
                if canonicalize_name(a.name) != canonicalize_name(b.name) or canonicalize_name(a.name) == "verl":
                    continue
                for version in exact_versions(a):
                    if not b.specifier.contains(version, prereleases=True):
                        found.append(f"{a_name} pins {a.name}=={version}, which {b.name}{b.specifier} excludes")
    return found


@pytest.mark.parametrize("extra", VERL_GPU_EXTRAS)
def test_the_plugin_admits_what_verls_gpu_extras_pin(extra):
    theirs = verl_requirements(extra)
    pins = {canonicalize_name(r.name): exact_versions(r) for r in theirs if exact_versions(r)}
    assert pins["torch"] == ["2.11.0"], pins  # what the README says the GPU path runs
    if extra != "fsdp":
        assert pins["transformers"] == ["5.9.0"] and ("vllm" in pins or "sglang" in pins), pins
    assert not conflicts(project_requirements(BESIDE_VERL), theirs)
    # the plugin's own verl pin is the version these extras belong to
    assert [str(r.specifier) for r in project_requirements(()) if r.name == "verl"] == ["==0.9.1"]


def test_the_gpu_extra_leaves_torch_transformers_and_the_rollout_engine_to_verl():
    names = {canonicalize_name(r.name) for r in project_requirements(("gpu",))}
    verls = {canonicalize_name(r.name) for extra in VERL_GPU_EXTRAS for r in verl_requirements(extra)}
    pinned_by_us = {canonicalize_name(r.name) for r in project_requirements(("gpu",)) if exact_versions(r)}
    assert not pinned_by_us & verls, pinned_by_us & verls
    assert not names & {"vllm", "sglang", "transformers"}


def test_the_comparison_catches_a_pin_verl_excludes():
    theirs = verl_requirements("vllm")
    assert conflicts([Requirement("torch==2.13.0")], theirs) == [
        "verl pins torch==2.11.0, which torch==2.13.0 excludes",
        "odc-verl pins torch==2.13.0, which torch==2.11.0 excludes",
    ]
    assert conflicts(project_requirements(("cpu",)), theirs)  # the cpu extra is not for beside verl's GPU stack
