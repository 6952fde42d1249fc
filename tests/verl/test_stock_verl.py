"""With the plugin installed, a run of other strategies is stock verl: verl's real trainer (`main_ppo`,
odc-grpo-cpu's configuration with the KL loss, 2 CPU ranks) under fsdp2 with the plugin loaded, against
the same run with the plugin not loaded at all (only the VERL_PLATFORM=cpu machinery, which any CPU run
needs), metric for metric; and every process of the plugin's run holds verl's own trainer and worker
classes, with verl's own functions and dispatch, as verl defined them (tests/verl/stock_probe.py records
them before any plugin loads). The plugin's run is made with verl reporting another version (0.9.2), which
changes nothing for it either: it still trains, equal to the run without the plugin, while the odc run of
that version fails at start, in one line naming both versions. A few minutes (three runs, one of them short).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest

from odc_plugin.verl.cpu.assets import ensure_assets
from tests.verl import golden
from tests.verl.trainer_runs import train

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
# readings of time and memory (`perf/...`, `actor/perf/...`, `mfu`), which differ between any two runs;
# every other metric must be equal
UNEQUAL = ("timing", "perf/", "mfu")
# what the plugin adds to verl's classes: the choice between verl's trainer class and the odc subclass (the legacy
# trainer's refuses odc)
CHOICE = ["PPOTrainer.__new__", "RayPPOTrainer.__new__"]
# the version verl reports in the plugin's runs (tests/verl/stock_probe.py)
OTHER_VERSION = "0.9.2"
ODC_REFUSED = (
    "strategy=odc needs verl 0.9.1, the version odc-verl's patches of verl were written for, but verl "
    f"{OTHER_VERSION} is installed; install verl==0.9.1 for odc runs (runs of other strategies do not use the patches)"
)


@contextlib.contextmanager
def _env(**values):
    """The run's processes (driver, Ray, workers) inherit the test's environment: set these for one run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("VERL_USE_EXTERNAL_MODULES", "tests.verl.stock_probe")
        for key, value in values.items():
            mp.setenv(key, value)
        yield


def _probes(probe_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(probe_dir.glob("*.json"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("stock_verl")
    assets = ensure_assets()
    found = {}
    for name, env in (
        ("without plugin", {"VERL_USE_EXTERNAL_PLUGINS": "none", "ODC_PROBE_CPU_ONLY": "1"}),
        ("with plugin", {"ODC_PROBE_VERL_VERSION": OTHER_VERSION}),
    ):
        probe_dir = out / f"probe-{name.replace(' ', '-')}"
        probe_dir.mkdir()
        with _env(ODC_PROBE_DIR=str(probe_dir), **env):
            found[name] = train(out, assets, name.replace(" ", "-"), "fsdp2", STEPS, golden.KL_LOSS)
        found[name].probes = _probes(probe_dir)
    with _env(ODC_PROBE_VERL_VERSION=OTHER_VERSION):
        found["odc"] = train(out, assets, f"verl-{OTHER_VERSION}-odc", "odc", 1, timeout_s=300)
    return found


def _compared(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not any(word in k for word in UNEQUAL)}


def test_an_fsdp2_run_with_the_plugin_equals_one_without_it(runs):
    without, plugin = runs["without plugin"], runs["with plugin"]
    without.assert_ok(STEPS)
    plugin.assert_ok(STEPS)
    for step in range(1, STEPS + 1):
        a, b = _compared(without.metrics[step]), _compared(plugin.metrics[step])
        assert a.keys() == b.keys(), a.keys() ^ b.keys()
        differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not differ, (step, differ)  # bit for bit
        assert a["actor/grad_norm"] > 0 and "actor/kl_loss" in a


def test_every_process_of_the_fsdp2_run_holds_verls_own_classes_and_functions(runs):
    for name, allowed in (("without plugin", []), ("with plugin", CHOICE)):
        probes = runs[name].probes
        workers = [p for p in probes if "verl.workers.engine_workers.TrainingWorker" in p["held"]]
        drivers = [p for p in probes if any(h.startswith("verl.trainer.ppo.v1.") for h in p["held"])]
        # the trainer (TaskRunner) and both training ranks, each with its actor, reference model and the
        # TrainingWorkers inside them, are verl's own classes
        assert len(drivers) == 1 and len(workers) == 2, [(p["argv"], p["held"]) for p in probes]
        # the trainer, and the worker class it maps the actor's role to (Ray's remote class of it)
        assert drivers[0]["held"] == [
            "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync",
            "verl.workers.engine_workers.ActorClass(ActorRolloutRefWorker)",
        ]
        for worker in workers:
            assert worker["held"] == [
                "verl.workers.engine_workers.ActorClass(ActorRolloutRefWorker)",
                "verl.workers.engine_workers.ActorRolloutRefWorker",
                "verl.workers.engine_workers.TrainingWorker",
            ]
        assert drivers[0]["added"] == allowed  # the plugin's one addition, the choice, acts in the driver only
        for probe in (*drivers, *workers):
            assert "TrainingWorker.train_mini_batch dispatch" in probe["recorded"]
            assert probe["changed"] == [], (name, probe)  # no member of verl's classes was replaced
            assert set(probe["added"]) <= set(allowed), (name, probe)


def test_another_verl_version_fails_odc_runs_only_at_start_in_one_line(runs):
    fsdp2, odc = runs["with plugin"], runs["odc"]
    fsdp2.assert_ok(STEPS)  # and equal to the run without the plugin, on verl's own version (above)
    # the CPU machinery says once per process that it applies on a verl it was not written for
    assert re.search(
        rf"odc's CPU patches target verl 0.9.1, but verl {OTHER_VERSION} is installed; they apply where their checks",
        fsdp2.log(),
    )
    odc.assert_refused_at_start(f"PatchError: {ODC_REFUSED}")
