"""verl's SFT trainers (`torchrun -m verl.trainer.sft_trainer`, `python -m verl.trainer.sft_trainer_ray`)
under odc against fsdp2, on CPU ranks.

Every run is verl's real trainer started as a user starts it (odc-sft-cpu's commands): the same data,
weights and settings, the strategy alone differing; each trainer against itself. Compared step by step:
train/loss and train/grad_norm to 1e-5, val/loss; LB-Mini's shares uneven where a rank is slow; a checkpoint of one
strategy resumed by the other; the longest samples split over groups of 2 and 4 ranks (`odc_split=auto`).
"""

from __future__ import annotations

import json
import os

import pytest

from odc_plugin.verl.cpu import SLOW_RANKS_ENV
from odc_plugin.verl.cpu import sft as sft_cpu
from odc_plugin.verl.cpu.assets import ensure_assets

TOLERANCE = 1e-5
STEPS = 3


def _metrics(path: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8") as fp:
        for line in fp:
            record = json.loads(line)
            steps.setdefault(record["step"], {}).update(record["data"])
    return steps


def _by_trainer(fixture: str) -> list:
    """A fixture's params, one per trainer, each an xdist group of its own: each is a few trainer runs."""
    return [pytest.param(t, marks=pytest.mark.xdist_group(f"tests/verl/test_sft.py::{fixture}::{t}")) for t in TRAINERS]


TRAINERS = ("torchrun", "ray")


def _start(tmp, name: str, ranks: int, strategy: str, extra=(), env=None, ray=False, per_rank=4, seed=0):
    """One run of verl's SFT trainer: (exit code, its output directory, its log)."""
    out = str(tmp / name)
    os.makedirs(out, exist_ok=True)
    files = sft_cpu.write_data(out, ranks * per_rank * STEPS, ranks * 4, seed=seed, emulation=None)
    shared = sft_cpu.settings(ensure_assets().model_dir, files, ranks, STEPS, per_rank, emulated=False)
    args = sft_cpu.run_args(shared, strategy, list(extra), out)
    code, _, log = sft_cpu.run_trainer(strategy, ranks, args, out, env or {}, timeout_s=600, ray=ray)
    return code, out, log


def _run(tmp, name: str, ranks: int, strategy: str, extra=(), env=None, ray=False, **data) -> dict:
    code, out, log = _start(tmp, name, ranks, strategy, extra, env, ray, **data)
    assert code == 0, sft_cpu.last_error(log)
    return {"dir": out, "metrics": _metrics(os.path.join(out, f"{strategy}.jsonl"))}


def _assert_same_training(base: dict, cand: dict, steps) -> None:
    for step in steps:
        for key in ("train/loss", "train/grad_norm"):
            b, c = base[step][key], cand[step][key]
            assert abs(c - b) <= TOLERANCE * abs(b), f"step {step} {key}: fsdp2 {b}, odc {c}"


@pytest.fixture(scope="module", params=_by_trainer("two_ranks"))
def two_ranks(request, tmp_path_factory):
    """2 ranks, dynamic batch size, checkpoints at step 2: fsdp2 and odc, then each resumed by the other."""
    tmp, ray = tmp_path_factory.mktemp(f"sft2-{request.param}"), request.param == "ray"
    save = ["trainer.save_freq=2"]
    runs = {s: _run(tmp, s, 2, s, save, ray=ray) for s in ("fsdp2", "odc")}
    for strategy, other in (("odc", "fsdp2"), ("fsdp2", "odc")):
        checkpoint = os.path.join(runs[other]["dir"], "checkpoints", other, "global_step_2")
        resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={checkpoint}"]
        runs[f"{strategy}_from_{other}"] = _run(tmp, f"{strategy}_from_{other}", 2, strategy, resume, ray=ray)
    return runs


def test_odc_trains_as_fsdp2_every_step_with_validation(two_ranks):
    fsdp2, odc = two_ranks["fsdp2"]["metrics"], two_ranks["odc"]["metrics"]
    _assert_same_training(fsdp2, odc, range(1, STEPS + 1))
    assert abs(odc[STEPS]["val/loss"] - fsdp2[STEPS]["val/loss"]) <= TOLERANCE * fsdp2[STEPS]["val/loss"]
    # flat numbers, one per key, as verl's SFT logger needs them
    assert isinstance(odc[1]["odc/compute_s_max"], float) and "odc_balance/efficiency" in odc[1]


@pytest.mark.parametrize("resumed", ["odc_from_fsdp2", "fsdp2_from_odc"])
def test_a_checkpoint_of_one_strategy_resumes_under_the_other(two_ranks, resumed):
    """The resumed run trains step 3 on the batch step 3 trains on without a stop, to the same loss."""
    run = two_ranks[resumed]["metrics"]
    assert min(run) == STEPS, f"{resumed} logged steps {sorted(run)}: it did not resume at step 2"
    _assert_same_training(two_ranks["fsdp2"]["metrics"], run, [STEPS])


@pytest.fixture(scope="module", params=_by_trainer("slow_rank"))
def slow_rank(request, tmp_path_factory):
    """4 ranks, rank 1 ten times slow, a fixed micro-batch size of 2. Ten, not less: Ray's 4 ranks sharing 2
    cores (and other tests' processes) measure it only 2-3 times slower than the others (at five, 1.8), and
    the measured balance is then noisy enough (the fit's error 0.35-0.45) that a smaller slowdown's gain can
    fall under it."""
    tmp = tmp_path_factory.mktemp(f"sft4-{request.param}")
    fixed = ["data.use_dynamic_bsz=False", "data.micro_batch_size_per_gpu=2"]
    env = {SLOW_RANKS_ENV: "1:10"}
    return {s: _run(tmp, s, 4, s, fixed, env, ray=request.param == "ray")["metrics"] for s in ("fsdp2", "odc")}


def test_a_slow_rank_gets_less_work_and_training_is_unchanged(slow_rank):
    _assert_same_training(slow_rank["fsdp2"], slow_rank["odc"], range(1, STEPS + 1))
    odc = slow_rank["odc"]
    # after the first step's fit, LB-Mini moves work off the slow rank unless its plan would gain too little
    shares = {s: odc[s]["odc_balance/slowest_rank_tokens"] for s in odc if "odc_balance/slowest_rank_tokens" in odc[s]}
    lighter = [s for s, share in shares.items() if share < 1]
    assert lighter, f"the slowest rank's tokens over the mean, by step: {shares}"


@pytest.mark.xdist_group("tests/verl/test_sft.py::split")
def test_the_longest_samples_split_over_groups_of_ranks_train_as_fsdp2(tmp_path):
    """4 ranks, 2 samples a rank (seed 2: a sample split over 2 ranks at step 1, over 4 at step 2, none at step
    3); odc_split=auto against fsdp2, every step, and the split metrics saying so."""
    data = {"per_rank": 2, "seed": 2}
    fsdp2 = _run(tmp_path, "fsdp2", 4, "fsdp2", **data)["metrics"]
    odc = _run(tmp_path, "odc", 4, "odc", ["engine.odc_split=auto", "engine.odc_cost_model=tokens"], **data)
    odc = odc["metrics"]
    _assert_same_training(fsdp2, odc, range(1, STEPS + 1))
    assert abs(odc[STEPS]["val/loss"] - fsdp2[STEPS]["val/loss"]) <= TOLERANCE * fsdp2[STEPS]["val/loss"]
    groups = {odc[step]["odc/split/max_group"] for step in odc if "odc/split/max_group" in odc[step]}
    assert {2.0, 4.0} <= groups, f"largest split group by step: {groups}"
    assert sum(odc[step].get("odc/split/samples", 0) for step in odc) >= 2
    # step 1 in tokens (nothing measured yet: its all-to-alls left out), then in seconds at the throughput of
    # the step before, near the slowest rank's measured compute
    unit = {1: "cost", 2: "s"}
    predicted = {s: [odc[s][f"odc_balance/{w}split_predicted_{unit[s]}"] for w in ("", "un")] for s in unit}
    assert all(split < unsplit for split, unsplit in predicted.values()), predicted
    assert 0.5 < predicted[2][0] / odc[2]["odc/compute_s_max"] < 2, (predicted[2], odc[2]["odc/compute_s_max"])


def test_the_sft_trainer_class_is_verls_without_odc_and_refuses_main_ppos_key():
    from omegaconf import OmegaConf
    from verl.trainer import sft_trainer, sft_trainer_ray

    from odc_plugin.verl import sft
    from odc_plugin.verl.trainer import trainer_class

    stock = OmegaConf.create({"engine": {"strategy": "fsdp2"}})
    assert trainer_class(sft_trainer.SFTTrainer, stock) is sft_trainer.SFTTrainer
    odc = OmegaConf.create({"engine": {"strategy": "odc"}})
    assert issubclass(trainer_class(sft_trainer.SFTTrainer, odc), sft_trainer.SFTTrainer)
    wrong_key = OmegaConf.create({"engine": {"strategy": "fsdp2"}, "model_engine": "odc"})
    with pytest.raises(ValueError, match="engine.strategy=odc"):
        trainer_class(sft_trainer.SFTTrainer, wrong_key)
    assert issubclass(trainer_class(sft_trainer_ray.SFTTrainer, odc), sft_trainer_ray.SFTTrainer)
    other = type("SFTTrainer", (), {"__module__": "verl.trainer.sft_trainer_other"})
    with pytest.raises(ValueError, match="python -m verl.trainer.sft_trainer_ray"):
        trainer_class(other, odc)
    assert sft.wants_odc(OmegaConf.create({"engine": {"_target_": sft.ODC_ENGINE_CONFIG, "strategy": "odc"}}))


def test_a_vision_language_model_is_refused_at_start_in_one_line(tmp_path):
    from odc_plugin.verl.cpu.assets import VL_MODEL

    vl = ensure_assets(model=VL_MODEL).model_dir
    code, out, log = _start(tmp_path, "vl", 2, "odc", [f"model.path={vl}", "model.trust_remote_code=True"])
    assert code != 0 and not os.path.exists(os.path.join(out, "odc.jsonl"))
    assert sft_cpu.last_error(log) == (
        "ValueError: odc: verl's SFT trainers do not train a vision-language model under odc (not yet checked); "
        "set engine.strategy=fsdp2"
    )


@pytest.mark.parametrize(
    "setting, error",
    [
        (
            "data.train_batch_size=7",  # verl's equal split fails at the first step, odc before it
            "odc: data.train_batch_size=7 does not divide over the 2 data-parallel ranks; give it a multiple of 2",
        ),
        (
            "engine.odc_split=auto",
            "odc: odc_split=auto runs in verl's torchrun SFT trainer (torchrun -m verl.trainer.sft_trainer); set "
            "engine.odc_split=off for the Ray trainer",
        ),
    ],
)
def test_the_ray_trainer_refuses_at_start_in_one_line(tmp_path, setting, error):
    code, out, log = _start(tmp_path, "odc", 2, "odc", [setting], ray=True)
    assert code != 0 and not os.path.exists(os.path.join(out, "odc.jsonl"))
    assert sft_cpu.last_error(log) == f"ValueError: {error}"


def test_the_ray_trainers_cluster_holds_its_resource_pool():
    """Ray schedules verl's workers only once every bundle fits: a bundle of max_colocate_count CPUs a rank."""
    from verl.single_controller.ray.base import RayResourcePool

    for ranks in (2, 16, 64):
        _, env = sft_cpu.trainer_command(ranks, [], True, "/tmp/unused")
        resources = json.loads(env["RAY_OVERRIDE_RESOURCES"])
        assert resources["GPU"] == ranks
        assert resources["CPU"] >= ranks * RayResourcePool([ranks]).max_colocate_count
