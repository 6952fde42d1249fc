"""A batch of the same rollouts arrives in the same order in every CPU run.

verl 0.9.1's v1 trainer names each prompt with `uuid.uuid4()` (`trainer/ppo/v1/trainer_base.py`,
and 1051 for validation) and its replay buffer hands the trainer a batch in the order the trajectories
reached TransferQueue (`trainer/ppo/v1/replay_buffer.py`, `_materialize_batch`), which is the
order in which the agent loop's concurrent requests happened to finish. `_balance_batch` partitions the
batch in that order, and with several mini-batches per step the order decides which samples each
optimizer step trains on. Two runs of the same job (an fsdp2 run and an odc run) would then train
different mini-batches from the same rollouts, and could not be compared step by step.

On CPU (`VERL_PLATFORM=cpu`, `odc-grpo-cpu`) this patch names prompts by a counter instead, in the order
the data loader yields them, and sorts each sampled batch by prompt, then by the response's tokens (the
`hf` rollout draws a prompt's responses from seeds of their arrival order, so which session got which
response varies, while the responses themselves do not): the same rollouts make the same batch, in the
same order, in every run, whatever the strategy. GPU runs keep
verl's behaviour; under it fsdp2 and odc train the same mini-batches for any given order
(odc_plugin/verl/dispatch.py), only the order itself varies from run to run.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
import uuid

from odc_patches import PatchError, require_attr

NAME = "cpu_batch_order"
TARGET = "verl.trainer.ppo.v1.trainer_base"
REPLAY_BUFFER_MODULE = "verl.trainer.ppo.v1.replay_buffer"


def _prompt(key: str) -> str:
    """The prompt of a TransferQueue key `{uid}_{session}_{index}` (agent_loop_tq.py)."""
    return key.rsplit("_", 2)[0]


def apply() -> None:
    import importlib

    trainer_base = importlib.import_module(TARGET)
    replay_buffer = importlib.import_module(REPLAY_BUFFER_MODULE)
    if getattr(require_attr(trainer_base, "uuid", NAME), "_odc_patched", False):
        return
    if trainer_base.uuid is not uuid:
        raise PatchError(f"odc patch '{NAME}': {TARGET}.uuid is no longer the uuid module")
    buffer = require_attr(replay_buffer, "ReplayBuffer", NAME)
    materialize = require_attr(buffer, "_materialize_batch", NAME)
    params = list(inspect.signature(materialize).parameters)
    if params != ["self", "partition_id", "selected_prompt_uids", "partition_snapshot"]:
        raise PatchError(f"odc patch '{NAME}': ReplayBuffer._materialize_batch{inspect.signature(materialize)} changed")

    # Zero-padded hex of a counter: names sort in the order they were made.
    counter = itertools.count(1)
    trainer_base.uuid = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=next(counter)), _odc_patched=True)

    @functools.wraps(materialize)
    def _materialize_batch(self, partition_id, selected_prompt_uids, partition_snapshot):
        import transfer_queue as tq

        batch = materialize(self, partition_id, selected_prompt_uids, partition_snapshot)
        responses = tq.kv_batch_get(keys=batch.keys, partition_id=partition_id, select_fields=["responses"])
        tokens = [tuple(r.tolist()) for r in responses["responses"].unbind()]
        order = sorted(range(len(batch.keys)), key=lambda i: (_prompt(batch.keys[i]), tokens[i]))
        return type(batch)(
            partition_id=batch.partition_id,
            keys=[batch.keys[i] for i in order],
            tags=[batch.tags[i] for i in order],
        )

    buffer._materialize_batch = _materialize_batch
