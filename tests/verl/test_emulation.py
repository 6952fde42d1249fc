"""odc-grpo-cpu --emulate's parts that need no trainer: the drawn response lengths (the rl profile, a file,
the `hf` rollout generating to them), and the planner's time of the passes the ranks recorded. The
trainer run itself: tests/verl/test_trainer_emulated.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from odc_plugin.balance.lengths import RL_PROFILE, rl_math_like
from odc_plugin.balance.step_time import simulate_minibatch
from odc_plugin.layer_time import EmulationFit
from odc_plugin.models import build_qwen2
from odc_plugin.verl.cpu import EMULATION_ENV
from odc_plugin.verl.cpu.emulation import Emulation, phase_times, record_pass

ROOT = Path(__file__).resolve().parents[2]
FIT_FILE = str(ROOT / "configs" / "cost_fit" / "Qwen2.5-7B-H100.json")


def test_drawn_response_lengths_follow_the_rl_profile_and_each_request_seed():
    emulation = Emulation(None, length_factor=64, response_lengths="rl")
    assert emulation.max_response_tokens() == RL_PROFILE["max_response_length"] // 64 == 256
    drawn = [emulation.response_tokens(seed) for seed in range(2000)]
    assert drawn[:50] == [emulation.response_tokens(seed) for seed in range(50)]  # the seed decides
    assert 1 <= min(drawn) and max(drawn) <= 256
    # the same distribution as odc-demo's rl case, in units of 64 tokens
    profile = np.array(rl_math_like(2000, **RL_PROFILE, seed=1).response_lens) / 64
    for q in (10, 50, 90):
        assert np.percentile(drawn, q) == pytest.approx(np.percentile(profile, q), rel=0.1), q


def test_a_lengths_file_is_a_profile_and_a_bad_profile_is_one_line(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("640\n1280\n")
    emulation = Emulation(None, length_factor=64, response_lengths=str(lengths))
    assert emulation.max_response_tokens() == 20
    assert {emulation.response_tokens(seed) for seed in range(40)} == {10, 20}
    for spec, message in (
        (str(tmp_path / "missing.txt"), "length file"),
        (str(ROOT / "pyproject.toml"), "expected one integer length per line"),
    ):
        with pytest.raises(ValueError) as info:
            Emulation(None, response_lengths=spec).check()
        assert str(info.value).startswith("--response-lengths: neither 'rl' nor a usable lengths file")
        assert message in str(info.value) and len(str(info.value).splitlines()) == 1
    with pytest.raises(ValueError, match="--length-factor must be an integer >= 1, got 0"):
        Emulation(None, length_factor=0)


def test_the_hf_rollout_generates_each_response_to_its_drawn_length(tmp_path, monkeypatch):
    """Real generation, held to the drawn length (the end-of-sequence token is held back until then), the
    same length for the same request in every run."""
    from odc_plugin.verl.cpu.rollout import HFRolloutServer, request_seed

    emulation = Emulation(None, length_factor=256, response_lengths="rl")
    spec = tmp_path / "emulation.json"
    emulation.save(str(spec))
    monkeypatch.setenv(EMULATION_ENV, str(spec))
    build_qwen2("tiny", seed=0).save_pretrained(tmp_path / "model")
    config = SimpleNamespace(dtype="float32", full_determinism=True, seed=3, max_model_len=None, response_length=64)
    model = SimpleNamespace(path=str(tmp_path / "model"), override_config={"attn_implementation": "sdpa"})

    def lengths(server, prompts):
        return [len(asyncio.run(server.generate("r", p, {"temperature": 1.0})).token_ids) for p in prompts]

    prompts = [[5, 17, 42], [8, 99, 3, 7], [5, 17, 42]]
    first = lengths(HFRolloutServer(config, model, 0), prompts)
    # each request's own seed (the weights' step 0, its prompt, its occurrence) draws its length
    seeds = [request_seed(3, 0, prompts[0], 0), request_seed(3, 0, prompts[1], 0), request_seed(3, 0, prompts[0], 1)]
    assert first == [emulation.response_tokens(seed) for seed in seeds]
    assert len(set(first)) > 1 and first == lengths(HFRolloutServer(config, model, 0), prompts)
    with pytest.raises(ValueError, match="drawn response lengths need rollout.full_determinism=True"):
        HFRolloutServer(SimpleNamespace(**{**vars(config), "full_determinism": False}), model, 0)


def _record(passes_dir, steps):
    """Two ranks, `steps` steps of one update pass each: rank 0 runs two micro-batches, rank 1 one or two."""
    plans = {0: [[[100], [50, 30]], [[120], [60]]], 1: [[[80], [40]], [[200], [10]]]}
    for step in range(steps):
        for rank, passes in plans.items():
            record_pass(passes_dir, rank, "update_actor", passes[step], 1.0)
            record_pass(passes_dir, rank, "old_log_prob", passes[step], 0.5)
    return plans


def test_phase_times_are_the_planners_time_of_the_passes_the_ranks_ran(tmp_path):
    plans = _record(str(tmp_path), 2)
    emulation = Emulation(FIT_FILE, time_scale=0.5, length_factor=64, passes_dir=str(tmp_path))
    fit = EmulationFit.load(FIT_FILE, 0.5)
    for lockstep in (True, False):
        times = phase_times(emulation, str(tmp_path), 2, [1.0, 1.5], lockstep=lockstep)
        for step in range(2):
            costs, plan = [], []
            for rank in (0, 1):
                plan.append([])
                for mb in plans[rank][step]:
                    plan[-1].append([len(costs)])
                    costs.append(fit.seconds([64 * s for s in mb]))
            want = simulate_minibatch(plan, costs, lockstep=lockstep, slowdown=[1.0, 1.5]).seconds
            assert times["update_actor"][step].predicted_s == pytest.approx(want)
            # a forward-only pass is the forward's share of the fit
            assert times["old_log_prob"][step].predicted_s == pytest.approx(want / (1 + fit.backward_ratio))
            busy = sum(c * f for rank, f in zip(plan, [1.0, 1.5]) for mb in rank for c in [costs[mb[0]]])
            assert times["update_actor"][step].busy_rank_s == pytest.approx(busy)
            assert times["update_actor"][step].idle_fraction(want) == pytest.approx(1 - busy / (2 * want))
            # the limit: the work over the ranks' summed speeds, or the longest sample on the fastest rank
            each = [fit.seconds([64 * s]) for rank in (0, 1) for mb in plans[rank][step] for s in mb]
            limit = max(sum(each) / (1 + 1 / 1.5), max(each))
            assert times["update_actor"][step].limit_s == pytest.approx(limit)
            assert times["update_actor"][step].samples == len(each) == (5, 4)[step]
    with pytest.raises(ValueError, match="not the same multiple of 3 steps"):
        phase_times(emulation, str(tmp_path), 3, [1.0, 1.5], lockstep=False)
