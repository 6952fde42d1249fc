"""verl's own configurations under `strategy=odc`: the settings of verl's GRPO and PPO example scripts
(examples/grpo_trainer/, examples/ppo_trainer/ in verl's repository) and policy losses of verl's registry,
each trained by verl's real trainer (`main_ppo`, 2 CPU ranks, 2 steps) under odc and compared step by step
with the same trainer's fsdp2 run from the same weights, on the same rollouts: the same rewards and lengths,
and the actor's (and critic's) gradient norm, policy loss, entropy, KL loss and value loss to the golden
metrics' tolerance. Each row is a golden configuration (tests/verl/golden.py): its fsdp2 run is the one its
golden file holds (`python -m tests.verl.golden --config NAME` makes it again), so a row runs odc alone, but a
row whose file says rounding decides some of its metrics (GMPO's policy loss near zero, KL-Cov's ranking of
tokens), which another CPU makes otherwise: it runs fsdp2 too, on this machine, and compares odc with that.
A setting odc cannot train as fsdp2 does is refused by odc at start with a one-line error instead (the loss
probe's, odc_plugin/verl/loss_probe.py), and that is a row here too: the line of the check the trainer runs
at start, on the run's own configuration, and one such row run through the trainer.

Settings that do not interact share a row, to keep the CI budget: about 2 minutes a row. Each row's
worst relative difference is written to `verl_settings.md` in the run's temporary directory (printed
with `-s`), the table README shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from odc_plugin.verl import ppo_config
from odc_plugin.verl.cpu import grpo
from odc_plugin.verl.cpu.assets import ensure_assets
from odc_plugin.verl.loss_check import check_losses
from tests.verl import golden
from tests.verl.trainer_runs import RANKS, train, worst_difference

STEPS = 2
REFRESH = "python -m tests.verl.golden --config "
ACTOR = "actor_rollout_ref.actor"
# what training computed: compared to the golden metrics' tolerance (the rollouts, golden.EXACT, exactly)
COMPARED = golden.CLOSE + golden.CRITIC
# PPO with a critic (examples/ppo_trainer/run_deepseek7b_llm.sh), the critic on fixed micro-batch sizes, which
# verl requires of it once the actor's are fixed (the critic's use_dynamic_bsz follows the actor's)
PPO_CRITIC = (
    "algorithm.adv_estimator=gae",
    "critic.optim.lr=1e-4",
    "critic.use_dynamic_bsz=False",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_mini_batch_size=4",
)
# each sample in a micro-batch of its own, as fsdp2 cuts its own, whatever rank runs it: a loss that depends on
# which samples share a micro-batch trains as under fsdp2
ONE_SAMPLE_MICRO_BATCHES = tuple(
    o.replace("micro_batch_size_per_gpu=2", "micro_batch_size_per_gpu=1") for o in golden.FIXED_MICRO_BATCHES
)


@dataclass(frozen=True)
class Setting:
    name: str  # the README row
    overrides: tuple[str, ...]
    slow_ranks: str | None = None
    uneven: bool = False  # LB-Mini must have given the ranks different shares in some step
    refused: bool = False  # odc refuses the row at start, with the line its loss probe gives
    odc_run: str = "odc"  # the run compared with fsdp2 (grpo.RUNS): odc, or odc with its options
    accumulate: str | None = None  # the accumulate method forced on the odc engines (odc_accumulate), if any
    golden: str | None = None  # the golden configuration of a row that trains: tests/verl/golden/<golden>.json
    steps: int = STEPS  # the training steps its runs make


SETTINGS = (
    Setting(
        "verl's example batching (run_qwen2-7b_math.sh): fixed micro-batch sizes (update 2, log-probs 4), "
        "4 mini-batches per step, low_var_kl KL loss, gradient checkpointing, reference param offload; "
        "uneven shares (rank 1 5x slow)",
        tuple(golden.EXAMPLE_BATCHING),
        golden.EXAMPLE_SLOW_RANKS,
        uneven=True,
        golden="grpo_cpu_example",
    ),
    Setting(
        "2 epochs, shuffled; entropy_coeff 0.01; clip ratios 0.1 / 0.15; GSPO (policy_loss.loss_mode=gspo) with "
        "seq-mean-token-mean; 2 mini-batches; odc's accumulate method forced to slots (odc_accumulate=slots); "
        "LoRA adapters (rank 8, all linear layers) synced unmerged: the rollout gets the base weights once, then "
        "the adapter every step, and generates step 2 with the one step 1 trained",
        (
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.model.target_modules=all-linear",
            "actor_rollout_ref.model.lora.merge=False",
            f"{ACTOR}.policy_loss.loss_mode=gspo",
            f"{ACTOR}.ppo_mini_batch_size=4",
            f"{ACTOR}.ppo_epochs=2",
            f"{ACTOR}.shuffle=True",
            f"{ACTOR}.entropy_coeff=0.01",
            f"{ACTOR}.clip_ratio_low=0.1",
            f"{ACTOR}.clip_ratio_high=0.15",
            f"{ACTOR}.loss_agg_mode=seq-mean-token-mean",
            f"{ACTOR}.fsdp_config.odc_accumulate=slots",
        ),
        accumulate="slots",
        golden="settings_gspo_lora",
    ),
    Setting(
        "GMPO (policy_loss.loss_mode=geo_mean: a mean over the micro-batch's sequences) with odc_balancer=lb_micro "
        "and fixed micro-batch sizes, which pack as fsdp2 does; actor param + optimizer offload; no_sync gradient "
        "accumulation; token-sum; mse KL loss; fixed micro-batch size 2; 2 mini-batches; odc's accumulate method "
        "forced to direct (odc_accumulate=direct)",
        (
            f"{ACTOR}.policy_loss.loss_mode=geo_mean",
            *golden.FIXED_MICRO_BATCHES,
            f"{ACTOR}.ppo_mini_batch_size=4",
            f"{ACTOR}.fsdp_config.param_offload=True",
            f"{ACTOR}.fsdp_config.optimizer_offload=True",
            f"{ACTOR}.fsdp_config.use_no_sync_for_gradient_accumulation=True",
            f"{ACTOR}.loss_agg_mode=token-sum",
            *golden.KL_LOSS,
            f"{ACTOR}.kl_loss_type=mse",
            f"{ACTOR}.fsdp_config.odc_accumulate=direct",
        ),
        odc_run="odc_lb_micro",
        accumulate="direct",
        golden="settings_gmpo_lb_micro",
    ),
    Setting(
        "PPO with a critic (run_deepseek7b_llm.sh), actor on fixed micro-batch sizes (the critic's keys for them set "
        "too, which verl 0.9.1's critic engine leaves for its token budget); CISPO (policy_loss.loss_mode=cispo) "
        "with seq-mean-token-sum-norm and loss_scale_factor; the critic's loss seq-mean-token-sum; the actor on "
        "FSDP2's own CPU offload (offload_policy); 2 mini-batches",
        (
            *PPO_CRITIC,
            "critic.loss_agg_mode=seq-mean-token-sum",
            *golden.FIXED_MICRO_BATCHES,
            f"{ACTOR}.ppo_mini_batch_size=4",
            f"{ACTOR}.policy_loss.loss_mode=cispo",
            f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm",
            f"{ACTOR}.loss_scale_factor=64",
            f"{ACTOR}.fsdp_config.offload_policy=True",
        ),
        golden="settings_ppo_cispo",
    ),
    Setting(
        "GMPO (policy_loss.loss_mode=geo_mean) under LB-Mini with a fixed micro-batch size of 1: each sample in a "
        "micro-batch of its own, as under fsdp2, whatever rank runs it; uneven shares (rank 1 5x slow), "
        "4 mini-batches",
        (
            f"{ACTOR}.policy_loss.loss_mode=geo_mean",
            f"{ACTOR}.ppo_mini_batch_size=2",
            *ONE_SAMPLE_MICRO_BATCHES,
        ),
        golden.EXAMPLE_SLOW_RANKS,
        uneven=True,
        golden="settings_gmpo_one_sample",
    ),
    Setting(
        "Clip-Cov (policy_loss.loss_mode=clip_cov) under LB-Mini with a fixed micro-batch size of 1 (GRPO: a lone "
        "response's covariance is 0, so it clips nothing; with GAE's advantages it is refused); 2 mini-batches",
        (f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.ppo_mini_batch_size=4", *ONE_SAMPLE_MICRO_BATCHES),
        golden="settings_clip_cov",
    ),
    Setting(
        # GAE's per-token advantages: with GRPO's, one per response, a lone response's covariance is 0 up to
        # rounding, and the token KL-Cov picks is whichever rounding favours (fsdp2 and odc agreed at step 1, and
        # picked other tokens at step 2, their weights 1e-7 apart: the policy loss 0.4% apart). With GAE's too the
        # one token a micro-batch it penalizes can be a near tie: from step 2, where two runs' weights differ by
        # rounding (odc's or fsdp2's on another number of ranks alike), odc's gradient norm came 2e-5 and 1.8e-3
        # from fsdp2's in two runs; so one step, from the same weights
        "KL-Cov (policy_loss.loss_mode=kl_cov) under LB-Mini with a fixed micro-batch size of 1, PPO with a critic "
        "(GAE's per-token advantages); 2 mini-batches; 1 step",
        (
            *PPO_CRITIC,
            f"{ACTOR}.policy_loss.loss_mode=kl_cov",
            f"{ACTOR}.ppo_mini_batch_size=4",
            *ONE_SAMPLE_MICRO_BATCHES,
        ),
        golden="settings_kl_cov",
        steps=1,
    ),
    Setting(
        "seq-mean-token-sum-norm without loss_scale_factor (each micro-batch's loss over its own padded length)",
        (f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm",),
        refused=True,
    ),
    Setting(
        "GMPO (policy_loss.loss_mode=geo_mean) with LB-Mini's packing",
        (f"{ACTOR}.policy_loss.loss_mode=geo_mean",),
        refused=True,
    ),
)


def golden_configs() -> dict[str, list[str]]:
    """The golden configurations of the rows that train (but the one golden.CONFIGS holds): odc-grpo-cpu's
    arguments, its run of fsdp2 and of the row's odc run."""
    return {
        s.golden: [
            "--steps",
            str(s.steps),
            "--compare",
            f"fsdp2,{s.odc_run}",
            *(["--slow-ranks", s.slow_ranks] if s.slow_ranks else []),
            *s.overrides,
        ]
        for s in SETTINGS
        if s.golden is not None and s.golden not in golden.CONFIGS
    }


def same_training(setting: Setting, runs: dict[str, dict[int, dict]]) -> tuple[float, str]:
    """Asserts that the row's odc run trains as fsdp2 does: every run of `runs` (odc's, and fsdp2's where the
    row's metrics are decided by rounding) as the golden file's fsdp2 run, but what rounding decides; odc's
    step by step as fsdp2's, that run's or the file's, to the golden tolerance. Returns the worst relative
    difference of odc from fsdp2 and where."""
    lines = golden.compare(runs, setting.golden, against="fsdp2")
    assert not lines, "\n".join([*lines, f"if the change is meant to move them: {REFRESH}{setting.golden}"])
    fsdp2 = runs.get("fsdp2") or golden.stored_run(setting.golden, "fsdp2")
    odc = runs[setting.odc_run]
    return worst_difference(fsdp2, odc, len(fsdp2), COMPARED, ("actor/grad_norm",), rtol=golden.rtol)


def _refusal(assets, out, overrides) -> str:
    """The line odc refuses a run of `overrides` with: the loss probe's, on the run's own configuration,
    through the entry the trainer calls at start (odc_plugin.verl.loss_check.check_losses)."""
    args = grpo.run_args(grpo.settings(assets, RANKS, 1, str(out)), "odc", list(overrides), str(out / "probe.jsonl"))
    with pytest.raises(ValueError) as refused:
        check_losses(ppo_config.compose(args))
    return str(refused.value)


@pytest.fixture(scope="module")
def assets():
    return ensure_assets()


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The README table of this module's rows, written as they finish."""
    rows: list[str] = []
    path = tmp_path_factory.mktemp("verl_settings") / "verl_settings.md"
    yield rows
    path.write_text(
        "| setting | same as fsdp2 (worst relative difference, step by step) | refused (the message) |\n"
        "|---|---|---|\n" + "".join(f"{row}\n" for row in rows)
    )
    print(f"\n{path}:\n{path.read_text()}")


@pytest.mark.parametrize(
    "setting",
    # a group a row: the two workers share the rows
    [
        pytest.param(s, id=f"row{i + 1}", marks=pytest.mark.xdist_group(f"settings-row{i + 1}"))
        for i, s in enumerate(SETTINGS)
    ],
)
def test_setting_trains_as_under_fsdp2_or_is_refused(setting, assets, tmp_path_factory, table):
    out = tmp_path_factory.mktemp("setting")
    if setting.refused:
        table.append(f"| {setting.name} | | `{_refusal(assets, out, setting.overrides)}` |")
        return
    steps = len(golden.stored_run(setting.golden, "fsdp2"))
    run = train(out, assets, setting.odc_run, setting.odc_run, steps, setting.overrides, slow_ranks=setting.slow_ranks)
    run.assert_ok(steps)
    odc = run.metrics
    runs = {setting.odc_run: odc}
    if golden.rounding_decided(golden.stored(setting.golden)["rounding"]):
        # what rounding decides, another CPU's stored fsdp2 run cannot: this machine's, the same settings
        fsdp2 = train(out, assets, "fsdp2", "fsdp2", steps, setting.overrides, slow_ranks=setting.slow_ranks)
        fsdp2.assert_ok(steps)
        runs["fsdp2"] = fsdp2.metrics
    worst, where = same_training(setting, runs)
    if setting.uneven:
        uneven = [s for s, m in odc.items() if m["odc_balance/samples_min"] < m["odc_balance/samples_max"]]
        assert uneven, {s: (m["odc_balance/samples_min"], m["odc_balance/samples_max"]) for s, m in odc.items()}
    if setting.accumulate is not None:
        chosen = f"actor/odc/transport/accumulate_{setting.accumulate}_chosen"
        assert all(m[chosen] == 1.0 for m in odc.values()), {s: m.get(chosen) for s, m in odc.items()}
    table.append(f"| {setting.name} | {worst:.1e} ({where}) | |")


def test_the_trainer_refuses_a_refused_setting_at_start_with_that_line(assets, tmp_path_factory):
    """verl's trainer calls check_losses at start, so a refused row's line is the trainer's: shown here for the
    row the loss probe refuses (the other refused rows' lines come from the same call)."""
    (setting,) = [s for s in SETTINGS if s.refused and "geo_mean" in " ".join(s.overrides)]
    out = tmp_path_factory.mktemp("refused")
    message = _refusal(assets, out, setting.overrides)
    run = train(out, assets, "odc", "odc", 1, setting.overrides)
    run.assert_refused_at_start(message)


# fsdp2's metrics that an Intel Xeon with AMX made otherwise than the golden files' CPU: KL-Cov's step 1, and
# GMPO's step 2 (its odc_lb_micro run's there, whose micro-batches are fsdp2's: the same run to the bit)
ANOTHER_CPU = {
    "settings_kl_cov": {"1": {"actor/grad_norm": 1.7454121112823486, "actor/pg_loss": -0.00345393834868446}},
    "settings_gmpo_lb_micro": {"2": {"actor/pg_loss": 2.76e-05}},
}


@pytest.mark.parametrize("config", ANOTHER_CPU)
def test_a_row_passes_against_another_cpus_file_and_fails_when_odc_trains_otherwise(config, tmp_path, monkeypatch):
    """The row's check, on the golden file's own runs (fsdp2 and odc as this machine made them), against that
    file with its fsdp2 metrics replaced by another CPU's: it passes, where a comparison with the file alone
    fails; and an odc run 1% off fsdp2's in any compared metric fails it."""
    (setting,) = [s for s in SETTINGS if s.golden == config]
    here = {run: golden.stored_run(config, run) for run in ("fsdp2", setting.odc_run)}
    elsewhere = golden.stored(config)
    for step, metrics in ANOTHER_CPU[config].items():
        elsewhere["metrics"]["fsdp2"][step].update(metrics)
    (tmp_path / f"{config}.json").write_text(json.dumps(elsewhere))
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path)
    odc_alone = golden.golden_metrics({setting.odc_run: here[setting.odc_run]})
    assert golden.differences(odc_alone, {setting.odc_run: elsewhere["metrics"]["fsdp2"]})
    same_training(setting, here)
    for step, metrics in here[setting.odc_run].items():
        for key in set(COMPARED) & set(metrics):
            changed = {**here, setting.odc_run: {**here[setting.odc_run], step: {**metrics, key: metrics[key] * 1.01}}}
            with pytest.raises(AssertionError):
                same_training(setting, changed)


def test_every_golden_file_says_what_rounding_decides():
    """Each file measured, for each of its fsdp2 run's metrics, how far another kernel set moves it (golden.py's
    `rounding`); a file without it would be compared across CPUs on metrics that rounding decides."""
    for name in golden.configs():
        file = golden.stored(name)
        moved = file["rounding"]["moved"]
        assert {step: set(m) for step, m in moved.items()} == {
            step: set(m) for step, m in file["metrics"]["fsdp2"].items()
        }, name
        assert file["rounding"]["against"] != file["rounding"]["kernels"], name


def test_every_row_that_trains_has_the_golden_file_of_its_configuration():
    """A row's overrides changed without its file made again would compare odc with another run's fsdp2."""
    for name, args in golden.configs().items():
        made_by = json.loads(golden.golden_file(name).read_text())["command"]
        assert made_by == f"odc-grpo-cpu {' '.join(args)}", f"{name}: made by {made_by}; run {REFRESH}{name}"
    assert all(s.refused or s.golden in golden.configs() for s in SETTINGS)
