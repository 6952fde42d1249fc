"""On CPU the rollout's time is the rollout's, not a multiple of the replay buffer's poll.

verl 0.9.1's v1 trainer times the rollout (`timing_s/gen`, `trainer/ppo/v1/trainer_base.py`) around
`ReplayBuffer.sample`, which checks TransferQueue for finished trajectories and, while there are too few,
sleeps `poll_interval` seconds (`trainer/ppo/v1/replay_buffer.py`). The trainer builds the buffer
without the argument (`_build_replay_buffer`, trainer_base.py), so the default of 2.0 s applies and
no config key reaches it. On a GPU that is a small part of a rollout of minutes; on CPU (`odc-grpo-cpu`) a
rollout takes seconds, so `timing_s/gen` came out as 2, 4, ... 12 s, and the A/B report's rollout control
(the same rollout under both strategies) read up to 1.22x from the grid alone.

With `VERL_PLATFORM=cpu` this patch makes the default `POLL_INTERVAL_S`, short against a CPU rollout and
long against a poll (one TransferQueue listing, a few milliseconds). A buffer built with an explicit
`poll_interval` keeps it; GPU runs keep verl's behaviour. (verl's separate-async trainer counts a wait for
samples longer than one poll as idle, `_step_had_idle`: on CPU that is then a wait longer than this one.)
"""

from __future__ import annotations

import inspect

from odc_patches import PatchError, replace_attr, require_attr

NAME = "cpu_replay_poll"
TARGET = "verl.trainer.ppo.v1.replay_buffer"
# verl's default, which this patch replaces
VERL_POLL_INTERVAL_S = 2.0
POLL_INTERVAL_S = 0.02


def apply() -> None:
    import importlib

    replay_buffer = importlib.import_module(TARGET)
    buffer = require_attr(replay_buffer, "ReplayBuffer", NAME)

    def short_poll(init):
        _check_buffer(buffer, init)

        def __init__(self, *args, **kwargs):
            bound = inspect.signature(init).bind(self, *args, **kwargs)
            bound.arguments.setdefault("poll_interval", POLL_INTERVAL_S)
            init(*bound.args, **bound.kwargs)

        return __init__

    replace_attr(buffer, "__init__", NAME, short_poll)


def _check_buffer(buffer, init) -> None:
    poll = inspect.signature(init).parameters.get("poll_interval")
    if poll is None or poll.default != VERL_POLL_INTERVAL_S:
        raise PatchError(
            f"odc patch '{NAME}': ReplayBuffer.__init__ has no poll_interval={VERL_POLL_INTERVAL_S} any more "
            f"({inspect.signature(init)})"
        )
    wait = inspect.getsource(require_attr(buffer, "_wait_for_next_poll", NAME))
    if "time.sleep(self.poll_interval)" not in wait:
        raise PatchError(f"odc patch '{NAME}': ReplayBuffer._wait_for_next_poll no longer sleeps self.poll_interval")
