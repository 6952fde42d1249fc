"""ODC's memory follows verl's lifecycle in verl's real trainer (`main_ppo` as `odc-grpo-cpu --steps 2` runs
it with the KL loss, so the reference model runs: 2 CPU ranks, the golden metrics' grpo_cpu configuration).

While the rollout generates, ODC holds no region but its transports' control words (a few KiB), seen from
outside the engines: at every generate request the rollout's server reads which of ODC's shared-memory
files the run's other processes map (tests/verl/rollout_watch.py). With the actor's parameter and
optimizer offload and the reference model's parameter offload on, and with them off; every step equals the
golden fsdp2 run's same step of that configuration (tests/verl/golden.py: rewards and lengths exactly, losses, gradient
norm and entropy to its tolerance), which test_main_ppo checks against a fresh fsdp2 run. On CPU offloading
moves nothing (the parameters already live there), so the run with offload has the metrics of the run
without. The runs' own metrics report what ODC held outside training (0), its extra bytes during a
mini-batch and its rebuild time per step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from odc_plugin.verl import ab_report
from odc_plugin.verl.cpu.assets import ensure_assets
from tests.fsdp.memory_workers import CONTROL_REGIONS
from tests.verl import golden
from tests.verl.rollout_watch import WATCH_ENV
from tests.verl.trainer_runs import train

STEPS = 2
ROOT = Path(__file__).resolve().parents[2]
ENV = "+ray_kwargs.ray_init.runtime_env.env_vars"
OFFLOAD = [
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out, assets = tmp_path_factory.mktemp("lifecycle"), ensure_assets()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(ROOT))  # the watch module, in every Ray worker
        done = {}
        for name, offload in (("offload", OFFLOAD), ("no_offload", [])):
            watch = out / f"{name}.watch.jsonl"
            watched = [f"{ENV}.VERL_USE_EXTERNAL_MODULES=tests.verl.rollout_watch", f"{ENV}.{WATCH_ENV}={watch}"]
            done[name] = train(out, assets, name, "odc", STEPS, [*golden.KL_LOSS, *offload, *watched])
            done[name].watch = [json.loads(line) for line in watch.read_text().splitlines()] if watch.exists() else []
    return done


@pytest.mark.parametrize("name", ["offload", "no_offload"])
def test_while_the_rollout_generates_odc_holds_only_its_control_words(runs, name):
    run = runs[name]
    run.assert_ok(STEPS)
    assert len(run.watch) >= STEPS, len(run.watch)  # the rollout's requests of every step were watched
    held = [p for record in run.watch for p in record["processes"].values()]
    assert held, "no process mapped any ODC file: the watch saw nothing"
    for files in held:
        assert {region for region, _, _ in files} <= CONTROL_REGIONS, files
        assert sum(nbytes for _, _, nbytes in files) <= 8192, files
    print(
        f"{name}: {len(run.watch)} generate requests watched; each training process mapped at most "
        f"{max(sum(n for _, _, n in files) for files in held)} bytes of ODC files (control words)"
    )
    for step, m in run.metrics.items():
        assert m["actor/odc/held_outside_bytes"] == 0 and m["actor/odc/ref/held_outside_bytes"] == 0, step
        print(
            f"  step {step}: rebuild {m['actor/odc/rebuild_s'] * 1e3:.0f} ms (actor), "
            f"{m['actor/odc/ref/rebuild_s'] * 1e3:.0f} ms (reference); "
            f"{m['actor/odc/extra_bytes_per_param']:.2f} extra bytes/param in a mini-batch"
        )
    # and odc-grpo-cpu's report says so
    report = ab_report.phase_report([ab_report.load_run(run.result.metrics_file, name)])
    (line,) = [line for line in report.splitlines() if line.startswith(f"ODC's regions ({name})")]
    assert line.endswith("held between phases, control words aside: 0 B"), line


@pytest.mark.parametrize("name", ["offload", "no_offload"])
def test_every_step_equals_fsdp2(runs, name):
    runs[name].assert_ok(STEPS)
    lines = golden.compare({name: runs[name].metrics}, "grpo_cpu", against="fsdp2", steps=STEPS)
    assert not lines, "\n".join(lines)
