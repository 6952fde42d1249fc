"""patches/cpu_batch_order.py: on CPU the same rollouts make the same batch in the same order in every run.

What it is for is shown end to end by tests/verl/test_verl_settings.py (fsdp2 and odc runs with four
mini-batches per step agree step by step, which they do not without it); here: the prompt names it
makes, and its refusals when verl changes under it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import uuid

import pytest

from odc_patches import PatchError, cpu_batch_order
from tests.verl.requires import needs_transfer_queue

pytestmark = needs_transfer_queue


@pytest.fixture
def stock(monkeypatch):
    """verl's trainer and replay buffer without the patch; put back after the test."""
    trainer_base = importlib.import_module(cpu_batch_order.TARGET)
    buffer = importlib.import_module(cpu_batch_order.REPLAY_BUFFER_MODULE).ReplayBuffer
    monkeypatch.setattr(trainer_base, "uuid", uuid)
    materialize = buffer._materialize_batch
    monkeypatch.setattr(buffer, "_materialize_batch", getattr(materialize, "__wrapped__", materialize))
    return trainer_base, buffer


def test_prompts_are_named_in_the_order_they_are_made(stock):
    trainer_base, buffer = stock
    cpu_batch_order.apply()
    names = [str(trainer_base.uuid.uuid4()) for _ in range(20)]
    assert names == sorted(names) and len(set(names)) == 20
    # the agent loop's keys are {uid}_{session}_{index}; a name has no "_" of its own
    assert cpu_batch_order._prompt(f"{names[3]}_2_0") == names[3]
    assert buffer._materialize_batch.__wrapped__ is not None
    before = trainer_base.uuid
    cpu_batch_order.apply()  # applying twice changes nothing
    assert trainer_base.uuid is before


def test_refuses_a_changed_replay_buffer(stock, monkeypatch):
    _, buffer = stock

    def _materialize_batch(self, partition_id, selected_prompt_uids):
        return None

    monkeypatch.setattr(buffer, "_materialize_batch", _materialize_batch)
    with pytest.raises(PatchError, match=r"_materialize_batch\(self, partition_id, selected_prompt_uids\) changed"):
        cpu_batch_order.apply()


def test_refuses_a_trainer_that_no_longer_names_prompts_with_uuid(stock, monkeypatch):
    trainer_base, _ = stock
    monkeypatch.setattr(trainer_base, "uuid", object())
    with pytest.raises(PatchError, match="is no longer the uuid module"):
        cpu_batch_order.apply()
    assert "uuid.uuid4()" in inspect.getsource(trainer_base.PPOTrainer)
