"""Checkpoint engine `gloo`: the trainer's weights to a standalone rollout over a gloo process group, on CPU.

verl sends weights to a rollout in other processes (`trainer.v1.trainer_mode=separate_async`'s standalone
rollout) through a checkpoint engine, and verl 0.9.1's are GPU libraries only (nccl and nixl need cupy,
hccl vLLM, mooncake and kimi their own packages); `naive` hands tensors over inside one process, which
separate_async refuses. This one implements verl's `CheckpointEngine` interface
(`verl/checkpoint_engine/base.py`) with what a CPU machine has: per update, training rank 0 hosts a c10d
store, it and the rollout's workers form one gloo group, every training rank drains the weight generator
(producing each full tensor is a collective over them) and rank 0 broadcasts the state dict, serialized,
to the rollout's workers, whose server adapters load it. Registered with VERL_PLATFORM=cpu
(`odc_plugin.verl.cpu`); select it with `actor_rollout_ref.rollout.checkpoint_engine.backend=gloo`.
"""

from __future__ import annotations

import datetime
import io

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

BACKEND = "gloo"
TIMEOUT = datetime.timedelta(seconds=600)


class GlooCheckpointEngine(CheckpointEngine):
    # verl's workers pass the bucket size and the backend's engine_kwargs; the state dict goes as one broadcast
    def __init__(self, bucket_size: int, is_master: bool = False, **kwargs) -> None:
        self.is_master = is_master  # training rank 0: the sender, and the host of the group's store
        self.rank, self.store, self.group = None, None, None

    def prepare(self) -> dict | None:
        if not self.is_master:
            return None
        import ray

        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        return {"host": host, "port": self.store.port}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        master, world_size = metadata[0], 1 + rollout_world_size
        # training ranks other than 0 are outside the group (rank -1): they only drain their generator
        actor = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict) -> None:
        self.rank = rank
        if rank < 0:
            return
        if self.store is None:
            self.store = dist.TCPStore(master["host"], master["port"], is_master=False, timeout=TIMEOUT)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, TIMEOUT)

    def finalize(self) -> None:
        self.rank, self.store, self.group = None, None, None

    def _broadcast(self, payload: torch.Tensor | None) -> torch.Tensor:
        size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
        self.group.broadcast(size, 0).wait()
        if payload is None:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self.group.broadcast(payload, 0).wait()
        return payload

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None):
        state = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            self._broadcast(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        payload = self._broadcast(None)
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        for item in state.items():
            yield item


def register() -> None:
    try:
        CheckpointEngineRegistry.get(BACKEND)  # verl's own, should it ever have one, stays
    except ValueError:
        CheckpointEngineRegistry.register(BACKEND)(GlooCheckpointEngine)
