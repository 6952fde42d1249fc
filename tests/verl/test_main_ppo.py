"""The user's path, end to end: verl 0.9.1's real `python -m verl.trainer.main_ppo` (v1 trainer, Ray,
TransferQueue, agent loop, reward scorer, weight sync to the rollout) with `strategy=fsdp2` and with
`strategy=odc`, on 2 CPU training ranks, through `odc-grpo-cpu` and the module behind it.

Every run is the real trainer in its own process tree; a run's metrics are what verl's `file` logger
wrote. The rollout is `hf` in deterministic mode, so two runs whose weights agree see the same
responses. A few minutes in all (each run ~1-2 minutes on 2 cores).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest

from odc_plugin.verl.ab_report import read_metrics
from odc_plugin.verl.cpu import grpo, runner
from odc_plugin.verl.cpu.assets import ensure_assets
from tests.verl import golden
from tests.verl.trainer_runs import RANKS, RUN_TIMEOUT_S, Trained, close, ray_session, train

ODC_OPTIONS = ["hydra.searchpath=[pkg://odc_plugin.configs]", "model_engine=odc"]
KL_LOSS = golden.KL_LOSS
PPO = [
    "algorithm.adv_estimator=gae",
    "critic.optim.lr=1e-4",
    # every step saved, with HF weights to compare across strategies
    "trainer.save_freq=1",
    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer,extra]",
    "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    "critic.checkpoint.load_contents=[model,optimizer,extra]",
]


@pytest.fixture(scope="module")
def assets():
    return ensure_assets()


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("main_ppo")


# ---------------------------------------------------------------------------------------------
# GRPO: odc-grpo-cpu, the command a user runs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpo_cli(out, assets):
    """`odc-grpo-cpu --steps 3` with the KL loss on (so the reference model is built as each strategy's engine)."""
    run_dir = out / "grpo"
    proc = subprocess.run(
        [sys.executable, "-m", "odc_plugin.verl.cpu.grpo", *golden.RUN_ARGS, "--out", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=2 * RUN_TIMEOUT_S,
    )
    with open(out / "runs.txt", "a") as fp:
        fp.writelines(
            f"grpo cli, {line}\n" for line in proc.stdout.splitlines() if line.startswith("run ") and " in " in line
        )
    runs = {s: read_metrics(str(run_dir / f"{s}.jsonl")) for s in grpo.STRATEGIES if (run_dir / f"{s}.jsonl").exists()}
    logs = {s: (run_dir / f"{s}.log").read_text(errors="replace") for s in runs}
    return proc, runs, logs


@pytest.mark.xdist_group("main_ppo-grpo_cli")
def test_grpo_cli_runs_both_strategies_and_reports(grpo_cli, out):
    proc, runs, _ = grpo_cli
    assert proc.returncode == 0, proc.stderr[-3000:]
    for strategy in grpo.STRATEGIES:
        assert sorted(runs[strategy]) == [1, 2, 3], strategy
        for step in (1, 2, 3):
            assert f"  {strategy}: step {step}/3 done" in proc.stdout
    # the exact command, and the one key that differs
    assert "VERL_PLATFORM=cpu" in proc.stdout and "-m verl.trainer.main_ppo" in proc.stdout
    assert "actor_rollout_ref.actor.strategy=fsdp2" in proc.stdout
    assert "the odc run differs in: actor_rollout_ref.actor.strategy=odc critic.strategy=odc" in proc.stdout
    assert "speedup odc over fsdp2: update phase" in proc.stdout
    assert "control: the rollout, which the strategy does not touch" in proc.stdout
    assert "LB-Mini plan efficiency" in proc.stdout
    # each run's own Ray session, not another test's running beside it
    ray_dirs = [ray_session(out / "grpo" / f"{s}.log") for s in grpo.STRATEGIES]
    assert all(ray_dirs) and not any(runner.ray_processes(d) for d in ray_dirs)


@pytest.mark.xdist_group("main_ppo-grpo_cli")
def test_odc_run_logs_odc_metrics_and_its_plans(grpo_cli):
    _, runs, _ = grpo_cli
    odc = runs["odc"]
    for metrics in odc.values():
        for key in (
            "actor/odc/compute_s_mean",
            "actor/odc/wait_s_max",
            "actor/odc/compute_imbalance",
            "odc_balance/efficiency",
            "odc_balance/samples_min",
            "odc_balance/samples_max",
        ):
            assert key in metrics, key
    assert not any(k.startswith(("actor/odc/", "odc_balance/")) for m in runs["fsdp2"].values() for k in m)
    # (Whether LB-Mini leaves verl's split here, with ranks of equal speed, depends on this machine's timings:
    # it moves work only for a predicted gain above its fit's error. test_verl_settings' rows 1 and 7, with
    # a slow rank, require uneven shares.)
    # the auto cost (the default): a fit after every update, its prediction checked from the second step
    # on, where the plans used it; the forward-only passes planned too
    for step, metrics in odc.items():
        for key in (
            "fit_c",
            "fit_a",
            "fit_b",
            "rank_speed_min",
            "rank_speed_max",
            "old_log_prob/efficiency",
            "ref_log_prob/efficiency",
        ):
            assert f"odc_balance/{key}" in metrics, (step, key)
        assert ("odc_balance/prediction_error" in metrics) == (step > 1), step
        assert 0.5 < metrics["odc_balance/rank_speed_min"] <= metrics["odc_balance/rank_speed_max"] < 2


@pytest.mark.xdist_group("main_ppo-grpo_cli")
def test_step_one_equals_fsdp2(grpo_cli):
    """One mini-batch per step, the same rollouts: the first update is the same math on the same data.

    fp32 everywhere; what differs is how the gradient sum is split and ordered (LB-Mini shares vs equal
    shares, ODC's accumulates vs gloo's reduce-scatter), so the two agree to float32 rounding of sums over a
    few thousand tokens: ~1e-7 relative. 1e-5 leaves room for that and catches any real difference (a
    dropped or doubled sample changes these by percents)."""
    _, runs, _ = grpo_cli
    fsdp2, odc = runs["fsdp2"][1], runs["odc"][1]
    for key in ("critic/score/mean", "response_length/mean", "prompt_length/mean"):  # the same rollouts
        assert fsdp2[key] == odc[key], key
    assert close(fsdp2["actor/grad_norm"], odc["actor/grad_norm"], 1e-5), (
        fsdp2["actor/grad_norm"],
        odc["actor/grad_norm"],
    )
    assert abs(fsdp2["actor/pg_loss"] - odc["actor/pg_loss"]) <= 1e-5 * max(1.0, abs(fsdp2["actor/pg_loss"]))
    assert fsdp2["actor/grad_norm"] > 0  # rewards vary within groups: there is something to learn


@pytest.mark.xdist_group("main_ppo-grpo_cli")
def test_both_runs_equal_the_golden_metrics(grpo_cli):
    """Rewards, lengths, losses and gradient norms of every step of both runs against the committed file
    (tests/verl/golden.py says why these tolerances); a change meant to move them refreshes the file."""
    _, runs, _ = grpo_cli
    lines = golden.compare(runs)
    assert not lines, "\n".join([*lines, "if the change is meant to move them: python -m tests.verl.golden"])


def test_the_golden_comparison_catches_small_changes():
    want = {"odc": {"2": {"actor/grad_norm": 0.5, "critic/score/mean": 0.25}}}
    same = {"odc": {"2": {"actor/grad_norm": 0.5 * (1 + 1e-4), "critic/score/mean": 0.25}}}
    assert golden.differences(same, want) == []
    nudged = {"odc": {"2": {"actor/grad_norm": 0.5 * (1 + 2e-3), "critic/score/mean": 0.25}}}
    assert golden.differences(nudged, want)[0].startswith("odc step 2 actor/grad_norm: 0.501")
    reward = {"odc": {"2": {"actor/grad_norm": 0.5, "critic/score/mean": 0.28125}}}
    assert golden.differences(reward, want) == ["odc step 2 critic/score/mean: 0.28125 vs golden 0.25 (rel 0.12)"]


@pytest.mark.xdist_group("main_ppo-grpo_cli")
def test_kl_loss_runs_with_the_reference_model_as_an_odc_engine(grpo_cli):
    _, runs, logs = grpo_cli
    for strategy in grpo.STRATEGIES:
        assert all("actor/kl_loss" in m for m in runs[strategy].values()), strategy
    assert "odc: ODCEngineWithLMHead (forward only) on 2 ranks over ShmTransport" in logs["odc"]
    assert "odc: ODCEngineWithLMHead on 2 ranks over ShmTransport" in logs["odc"]
    assert "odc: ODCEngine" not in logs["fsdp2"]


@pytest.mark.parametrize(
    "spec,message",
    [("2:1.5", "--slow-ranks: rank 2 is out of range for 2 ranks"), ("1", "--slow-ranks: '1' is not RANK:FACTOR")],
)
def test_cli_refuses_a_bad_slow_rank(tmp_path, capsys, spec, message):
    with pytest.raises(SystemExit):
        grpo.main(["--out", str(tmp_path), "--slow-ranks", spec])
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not list(tmp_path.glob("*.log"))


def test_cli_refuses_a_bad_override_before_any_training(tmp_path, capsys):
    assert grpo.main(["--out", str(tmp_path), "actor_rollout_ref.actor.no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("odc-grpo-cpu: verl rejects the fsdp2 run's configuration:")
    assert "no_such_key" in err[-1]
    assert not list(tmp_path.glob("*.log"))  # nothing was started
    # an odc engine option goes to the odc run only, which refuses a bad one: still nothing runs
    assert grpo.main(["--out", str(tmp_path), "actor_rollout_ref.actor.fsdp_config.odc_transport=tcp"]) == 2
    assert not list(tmp_path.glob("*.log"))


# ---------------------------------------------------------------------------------------------
# PPO with a critic, checkpoints across strategies
# ---------------------------------------------------------------------------------------------


def _checkpoint(run: Trained, step: int) -> str:
    return os.path.join(os.path.dirname(run.result.log_file), "checkpoints", f"global_step_{step}")


@pytest.fixture(scope="module")
def ppo(out, assets):
    """PPO with a critic as one chain of runs across strategies, every run saving every step: fsdp2 trains
    steps 1-3; odc resumes fsdp2's step-1 checkpoint and trains steps 2-3; fsdp2 resumes odc's step-2
    checkpoint and trains step 3. A resumed step starts from the same weights as the step it is compared
    with, so it sees the same rollouts."""
    fsdp2 = train(out, assets, "ppo-fsdp2", "fsdp2", 3, PPO)
    fsdp2.assert_ok(3)
    odc = train(
        out,
        assets,
        "ppo-odc",
        "odc",
        3,
        [*PPO, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={_checkpoint(fsdp2, 1)}"],
    )
    back = train(
        out,
        assets,
        "ppo-fsdp2-again",
        "fsdp2",
        3,
        [*PPO, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={_checkpoint(odc, 2)}"],
    )
    return {"fsdp2": fsdp2, "odc": odc, "fsdp2 again": back}


def _same_step(a: dict, b: dict) -> None:
    """The same rollouts, and updates that agree. Looser than test_step_one_equals_fsdp2's 1e-5: the actor's
    gradient here goes through GAE advantages built from the critic's values, which each strategy computes
    with its own float32 rounding; CI measured the actor's gradient norms 1.1e-5 apart on the same weights.
    1e-4 still catches a dropped or doubled sample, which moves these by percents."""
    for key in ("critic/score/mean", "response_length/mean"):
        assert a[key] == b[key], key
    for key in ("critic/values/mean", "critic/vf_loss", "critic/grad_norm", "actor/grad_norm"):
        assert close(a[key], b[key], 1e-4), (key, a[key], b[key])


@pytest.mark.xdist_group("main_ppo-ppo")
def test_ppo_with_a_critic(ppo):
    odc = ppo["odc"]
    assert odc.result.returncode == 0, grpo.last_error(odc.result.log_file)
    assert not runner.ray_processes(odc.result.ray_dir)
    for key in ("critic/odc/compute_s_mean", "critic/odc/wait_s_max", "odc_balance/critic/efficiency"):
        assert key in odc.metrics[2], key
    # the critic's values are those of the same model, its loss and gradient the same math
    _same_step(ppo["fsdp2"].metrics[2], odc.metrics[2])


def _hf_weights(run: Trained, step: int, role: str) -> dict:
    from safetensors.torch import load_file

    ckpt = os.path.join(_checkpoint(run, step), role, "huggingface")
    files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
    assert files, f"no HF weights under {ckpt}"
    state = {}
    for f in files:
        state.update(load_file(os.path.join(ckpt, f)))
    return state


@pytest.mark.xdist_group("main_ppo-ppo")
@pytest.mark.parametrize("saved_by, resumed_by", [("odc", "fsdp2 again"), ("fsdp2", "odc")])
def test_resume_a_checkpoint_under_the_other_strategy(ppo, saved_by, resumed_by):
    """A run resumed under the other strategy starts after the checkpoint's step, and its first step is the
    saving run's same step: same rollouts, same gradient norms, and saved weights equal to the saving run's,
    actor and critic. So the weights and optimizer state loaded are the ones saved."""
    saved, resumed = ppo[saved_by], ppo[resumed_by]
    first = {"odc": 2, "fsdp2 again": 3}[resumed_by]
    assert resumed.result.returncode == 0, grpo.last_error(resumed.result.log_file)
    assert sorted(resumed.metrics) == list(range(first, 4)), "the resumed run starts after the checkpoint's step"
    _same_step(saved.metrics[first], resumed.metrics[first])
    for role in ("actor", "critic"):
        want, got = _hf_weights(saved, first, role), _hf_weights(resumed, first, role)
        assert want.keys() == got.keys()
        worst = max((want[k] - got[k]).abs().max().item() for k in want)
        assert worst <= 1e-5, (role, worst)


# ---------------------------------------------------------------------------------------------
# The models RL users train: a mixture of experts (LoRA adapters: test_verl_settings' GSPO row)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_assets():
    return ensure_assets(model="qwen3_moe")


def _first_step_agrees(runs: dict[str, Trained], rtol: float = 1e-5) -> None:
    for run in runs.values():
        run.assert_ok(len(run.metrics))
    fsdp2, odc = runs["fsdp2"].metrics[1], runs["odc"].metrics[1]
    for key in ("critic/score/mean", "response_length/mean"):  # the same rollouts
        assert fsdp2[key] == odc[key], key
    # float32 rounding of differently split sums, as in test_step_one_equals_fsdp2
    assert close(fsdp2["actor/grad_norm"], odc["actor/grad_norm"], rtol), (
        fsdp2["actor/grad_norm"],
        odc["actor/grad_norm"],
    )
    assert fsdp2["actor/grad_norm"] > 0


@pytest.mark.xdist_group("main_ppo-moe")
def test_ppo_moe_actor_and_critic_first_step_equals_fsdp2_and_ranks_route_differently(out, moe_assets):
    """PPO with the tiny Qwen3-MoE as actor and critic (experts fused in transformers 5's layout; the rollout
    takes them per expert). The actor's gradient goes through GAE advantages from the critic's values, each
    strategy's own float32 rounding: 1e-4, as test_ppo_with_a_critic."""
    ppo = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-4"]
    runs = {s: train(out, moe_assets, "ppo-moe", s, 1, ppo) for s in grpo.STRATEGIES}
    _first_step_agrees(runs, rtol=1e-4)
    fsdp2, odc = runs["fsdp2"].metrics[1], runs["odc"].metrics[1]
    assert close(fsdp2["critic/grad_norm"], odc["critic/grad_norm"], 1e-4) and odc["critic/grad_norm"] > 0
    # both ranks routed tokens, not to the same experts in the same shares (~0.8% of routings differ)
    assert odc["actor/odc/moe/routing_divergence"] > 1e-3, odc["actor/odc/moe/routing_divergence"]
    assert "critic/odc/moe/routing_divergence" in odc
    loads = [odc[f"actor/odc/moe/expert_load_max_{rank}"] for rank in range(RANKS)]
    assert all(1 < load <= 4 for load in loads) and loads[0] != loads[1], loads
    print({k: v for k, v in odc.items() if "/moe/" in k})


ULYSSES = [
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
    *KL_LOSS,
]


@pytest.mark.xdist_group("main_ppo-ulysses")
def test_grpo_ulysses_4_ranks_first_step_equals_fsdp2(out, assets):
    """4 training ranks as 2 sequence-parallel groups of 2 (actor and reference, the KL loss on so the
    reference runs), verl's Ulysses path (heads exchanged under SDPA on CPU: patches/cpu_ulysses_sdpa.py)."""
    runs = {s: train(out, assets, "grpo-ulysses", s, 1, ULYSSES, ranks=4) for s in grpo.STRATEGIES}
    _first_step_agrees(runs)
    assert "odc: ODCEngineWithLMHead on 4 ranks over ShmTransport" in runs["odc"].log()


# ---------------------------------------------------------------------------------------------
# bad input and failing workers through the real trainer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting,error",
    [
        # refused by the config class, in the driver
        ("odc_transport=tcp", "ValueError(\"odc_transport must be one of auto, shm, cuda_ipc, nvshmem, got 'tcp'\")"),
        # refused by the engine as it starts, in a training worker, with other processes' warnings after it
        (
            "fsdp_size=1",
            "ValueError: fsdp_size=1 must divide the world size 2 and be at least 2 with strategy odc "
            "(ranks per node for HSDP; -1 shards over all ranks)",
        ),
    ],
    ids=["config", "engine-start"],
)
def test_invalid_odc_option_fails_at_start_up_summarized_by_its_exception(out, assets, setting, error):
    run = train(
        out,
        assets,
        f"bad-option-{setting.split('=')[0]}",
        "odc",
        1,
        [*ODC_OPTIONS, f"actor_rollout_ref.actor.fsdp_config.{setting}"],
        timeout_s=300,
    )
    assert run.result.returncode != 0
    assert grpo.last_error(run.result.log_file).endswith(error)
    assert run.result.steps == 0 and not run.metrics
    assert not runner.ray_processes(run.result.ray_dir)


def _train_and_kill_a_worker(out, assets, name: str, barrier_timeout_s: float):
    """An odc run; one of its own training workers (a child of its session's raylet: other tests' trainers
    may run beside it) is killed as soon as it is inside an actor update."""
    result: dict = {}
    overrides = [*ODC_OPTIONS, f"actor_rollout_ref.actor.fsdp_config.odc_barrier_timeout_s={barrier_timeout_s}"]
    (out / name).mkdir(exist_ok=True)
    log_file = out / name / "odc.log"
    log_file.unlink(missing_ok=True)
    thread = threading.Thread(target=lambda: result.update(run=train(out, assets, name, "odc", 3, overrides)))
    thread.start()
    hit_at = None
    while thread.is_alive() and hit_at is None:
        session = ray_session(log_file)
        raylets = {p.pid for p in runner.ray_processes(session)} if session else set()
        for proc in psutil.process_iter(["cmdline", "ppid"]):
            cmdline = proc.info["cmdline"] or [""]
            if proc.info["ppid"] in raylets and cmdline[0].startswith("ray::WorkerDict.actor_rollout_update_actor"):
                proc.kill()
                hit_at = time.monotonic()
                break
        time.sleep(0.05)  # an update lasts seconds; each look walks every process of the machine
    thread.join()
    assert hit_at is not None, "no actor update was seen"
    return result["run"], time.monotonic() - hit_at


@pytest.mark.xdist_group("main_ppo-killed")
def test_killed_worker_ends_the_job(out, assets):
    """The job ends at once, naming the death, well inside ODC's barrier timeout (the surviving rank would
    otherwise give up at the end of the mini-batch, naming the rank that did not arrive: tests/fsdp,
    test_killed_rank_makes_the_others_time_out_naming_it): Ray's ActorDiedError, or, where the surviving rank
    reaches its next ODC wait before Ray's notice reaches the driver (a loaded machine), ODC's line naming the
    process that exited."""
    run, after = _train_and_kill_a_worker(out, assets, "killed", barrier_timeout_s=30)
    assert run.result.returncode != 0
    error = grpo.last_error(run.result.log_file)
    odc_saw_it = re.search(r"process \(pid \d+\) has exited\); rank\(s\) \[\d\] did not arrive", error)
    assert "ActorDiedError" in error or odc_saw_it, error
    assert after < 30 + 60
    assert not runner.ray_processes(run.result.ray_dir)


@pytest.mark.xdist_group("main_ppo-split")
def test_grpo_split_over_groups_of_ranks_trains_as_fsdp2(out, assets):
    """odc-grpo-cpu at 4 ranks, one prompt of 4 responses a mini-batch (4 mini-batches a step), the KL loss
    on, response lengths drawn long-tailed (the emulated rl case at a small time scale): the update splits
    responses over groups of ranks (odc_split=auto) and trains as fsdp2, every step; the forward-only passes,
    four responses a rank, stay unsplit. Adam's eps at 1e-3: a mini-batch whose true gradient is zero (a
    prompt's responses all scored alike, the KL at its minimum) would otherwise turn the 1e-7 float
    differences between its unsplit reference log-probs and its split training forward into lr-sized steps
    (0.3-1% at step 1; where every pass splits alike they agree to the bit: the test below)."""
    fsdp2, split = _grpo_split(
        out / "grpo-split", 2, "actor_rollout_ref.actor.optim.override_optimizer_config={eps:1e-3}"
    )
    for step in (1, 2):
        assert split[step]["actor/odc/split/samples"] > 0 and split[step]["actor/odc/split/max_group"] == 4
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean"):
            base, cand = fsdp2[step][key], split[step][key]
            assert abs(cand - base) <= 1e-3 * abs(base), f"step {step} {key}: fsdp2 {base}, split {cand}"
        unit = "cost" if step == 1 else "s"  # in tokens until the first update has measured their throughput
        assert split[step][f"odc_balance/split_predicted_{unit}"] < split[step][f"odc_balance/unsplit_predicted_{unit}"]
    # seconds a mini-batch, at the first step's throughput, near the slowest rank's measured compute
    predicted = split[2]["odc_balance/split_predicted_s"] / split[2]["odc_balance/mini_batches"]
    assert 0.5 < predicted / split[2]["actor/odc/compute_s_max"] < 2, (predicted, split[2]["actor/odc/compute_s_max"])


def _grpo_split(run_dir, steps: int, *overrides: str) -> tuple[dict, dict]:
    """odc-grpo-cpu --compare fsdp2,split at 4 ranks, one prompt of 4 responses a mini-batch, lengths drawn
    long-tailed, the tokens cost: each run's metrics by step."""
    args = ["--ranks", "4", "--steps", str(steps), "--compare", "fsdp2,split", "--out", str(run_dir)]
    fit = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cost_fit", "Qwen2.5-7B-H100.json")
    args += ["--emulate", os.path.abspath(fit), "--time-scale", "0.05", "--rollout-fit", "none"]
    args += [
        "actor_rollout_ref.actor.fsdp_config.odc_cost_model=tokens",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "odc_plugin.verl.cpu.grpo", *args, *overrides],
        capture_output=True,
        text=True,
        timeout=2 * RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tuple(read_metrics(str(run_dir / f"{name}.jsonl")) for name in ("fsdp2", "split"))


@pytest.mark.xdist_group("main_ppo-split-passes")
def test_grpo_split_in_every_pass_keeps_a_zero_gradient_zero(out, assets):
    """One prompt a step, so that every pass has one response a rank: old log-probs, reference log-probs and
    the update all split each response over the same group, so the old and reference log-probs are the
    training forward's to the bit: the PPO ratio is exactly 1 (ppo_kl 0) and the first step's true gradient
    (its responses scored alike, the KL at its minimum) stays exactly zero at verl's own Adam eps, as under
    fsdp2; the passes' outputs (the old log-probs' entropy) equal fsdp2's."""
    fsdp2, split = _grpo_split(out / "grpo-split-passes", 2, "data.train_batch_size=1")
    for step in (1, 2):
        for stage in ("old_log_prob", "ref_log_prob", ""):
            assert split[step][f"odc_balance/{stage}{'/' if stage else ''}split_samples"] == 4  # every response
        assert split[step]["actor/ppo_kl"] == 0.0
        for key in ("actor/entropy", "actor/kl_loss", "actor/grad_norm", "response_length/mean"):
            base, cand = fsdp2[step][key], split[step][key]
            assert abs(cand - base) <= 1e-5 * abs(base) + 1e-7, f"step {step} {key}: fsdp2 {base}, split {cand}"
    assert fsdp2[1]["actor/grad_norm"] == split[1]["actor/grad_norm"] == 0.0
