"""patches/cpu_replay_poll.py: on CPU verl's replay buffer polls every POLL_INTERVAL_S, not every 2 s, and the
patch refuses a verl that changed under it. End to end (`timing_s/gen` off the 2 s grid): docs/results.md."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import time

import pytest

from odc_patches import PatchError, cpu_replay_poll
from tests.verl.requires import needs_transfer_queue

pytestmark = needs_transfer_queue


@pytest.fixture
def stock(monkeypatch):
    """verl's ReplayBuffer without the patch; put back after the test."""
    buffer = importlib.import_module(cpu_replay_poll.TARGET).ReplayBuffer
    init = buffer.__init__
    monkeypatch.setattr(buffer, "__init__", getattr(init, "__wrapped__", init))
    return buffer


def _build(cls, **kwargs):
    """A buffer as verl's trainer builds one for a sync GRPO run (trainer_base._build_replay_buffer)."""
    return cls(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        **kwargs,
    )


def test_the_trainers_buffer_polls_fast_and_an_explicit_interval_is_kept(stock):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    assert _build(stock).poll_interval == cpu_replay_poll.VERL_POLL_INTERVAL_S
    cpu_replay_poll.apply()
    patched = stock.__init__
    cpu_replay_poll.apply()  # applying twice changes nothing
    assert stock.__init__ is patched
    for cls in (stock, ReplayBufferAsync):
        buffer = _build(cls)
        assert buffer.poll_interval == cpu_replay_poll.POLL_INTERVAL_S
        start = time.perf_counter()
        buffer._wait_for_next_poll("train", time.time())  # verl's own wait between two looks at TransferQueue
        assert time.perf_counter() - start < 0.5
    assert _build(stock, poll_interval=0.7).poll_interval == 0.7
    # The trainer leaves the interval at its default, which is what the patch changes: if verl starts
    # passing one (a config key), this run's rollout is on verl's grid again and the patch must follow.
    assert "poll_interval" not in inspect.getsource(PPOTrainer._build_replay_buffer)


def _init_without_interval(self, trainer_mode, trainer_config, max_off_policy_threshold, max_off_policy_strategy):
    pass


def _init_with_another_default(self, trainer_mode, poll_interval: float = 1.0):
    pass


def _wait_without_sleep(self, partition_id, last_debug_time):
    return last_debug_time


@pytest.mark.parametrize(
    "method,replacement,message",
    [
        ("__init__", _init_without_interval, r"ReplayBuffer.__init__ has no poll_interval=2.0 any more"),
        ("__init__", _init_with_another_default, r"has no poll_interval=2.0 any more \(\(self, trainer_mode, poll"),
        ("_wait_for_next_poll", _wait_without_sleep, "_wait_for_next_poll no longer sleeps self.poll_interval"),
    ],
)
def test_refuses_a_buffer_whose_poll_changed(stock, monkeypatch, method, replacement, message):
    monkeypatch.setattr(stock, method, replacement)
    with pytest.raises(PatchError, match=message):
        cpu_replay_poll.apply()
    assert not getattr(stock.__init__, "_odc_patched", False)  # a refused patch changes nothing
