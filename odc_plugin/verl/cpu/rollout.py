"""Rollout `hf`: transformers `generate` behind verl's rollout-server interface, for machines without vLLM.

Three pieces, as verl 0.9.1 wires a rollout backend:

- `HFRolloutServer`, a Ray actor per replica: token ids in, token ids and log-probs out
  (`generate`, what verl's agent loop calls through `LLMServerClient`), plus the control calls verl
  makes on every server (sleep, wake_up, caches, abort...), which have nothing to do here.
- `HFReplica`, registered in verl's `RolloutReplicaRegistry` as `hf`: starts the server.
- `HFServerAdapter`, the in-worker side verl builds in each training rank (`get_rollout_class`): it
  receives the trainer's weights through verl's own sync path (`ActorRolloutRefWorker.update_weights`
  with `checkpoint_engine.backend=naive`) and ships them to its replica's server: full weights (put into
  the model's own layout, `weights.py`: MoE experts fused or not), or with LoRA and `merge=False` the
  base weights once and then the adapter, which the server's model generates with.

With `rollout.full_determinism=True` each request is sampled from its own seed: (rollout.seed, the
training step of the weights, prompt, how many times this prompt came before with these weights). Two
runs that sync the same weights at the same step then see the same responses, whatever order requests
arrive in (verl routes every such request to one server), also when one of them resumed from the
other's checkpoint. Otherwise sampling uses the process's global generator.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import Counter
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from . import ROLLOUT_NAME
from .weights import plain_name, to_model_layout

logger = logging.getLogger(__name__)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("bf16", "bfloat16").replace("fp32", "float32"), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"rollout.dtype must name a torch dtype (e.g. float32, bfloat16), got {name!r}")
    return dtype


def request_seed(base_seed: int, global_steps: int, prompt_ids: list[int], occurrence: int) -> int:
    key = f"{base_seed}/{global_steps}/{occurrence}/" + ",".join(map(str, prompt_ids))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


class HFRolloutServer:
    """One replica's generator: the model on CPU, requests served one at a time."""

    def __init__(self, config, model_config, replica_rank: int):
        from transformers import AutoModelForCausalLM

        self.config, self.replica_rank = config, replica_rank
        path = model_config.local_path if getattr(model_config, "local_path", None) else model_config.path
        override = dict(getattr(model_config, "override_config", None) or {})
        # the implementations the trainer's model was told to use (override_config), if any
        implementations = {key: override[key] for key in ("experts_implementation",) if key in override}
        self.model = AutoModelForCausalLM.from_pretrained(
            path,
            torch_dtype=_dtype(config.dtype),
            attn_implementation=override.get("attn_implementation", "sdpa"),
            **implementations,
        )
        self.model.eval()
        self.eos_token_id = self.model.generation_config.eos_token_id or self.model.config.eos_token_id
        self.pad_token_id = self.model.generation_config.pad_token_id or self.model.config.pad_token_id
        self.global_steps = 0  # the training step the current weights come from
        self._seen: Counter = Counter()  # (global_steps, prompt) -> requests so far, for full_determinism
        self._lock = asyncio.Lock()

    def ready(self) -> bool:
        return True

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data=None,
        video_data=None,
        **kwargs,
    ) -> TokenOutput:
        if image_data or video_data or kwargs.get("audio_data"):
            raise NotImplementedError(
                f"rollout '{ROLLOUT_NAME}' generates from text token ids only (no images, video or audio)"
            )
        prompt_ids = [int(t) for t in prompt_ids]
        async with self._lock:  # one generation at a time: a seeded request owns the generator it draws from
            seed = None
            if self.config.full_determinism:
                key = (self.global_steps, tuple(prompt_ids))
                seed = request_seed(self.config.seed, self.global_steps, prompt_ids, self._seen[key])
                self._seen[key] += 1
            return await asyncio.to_thread(self._generate, prompt_ids, dict(sampling_params), seed)

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], params: dict[str, Any], seed: int | None) -> TokenOutput:
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
        room = (self.config.max_model_len or self.model.config.max_position_embeddings) - len(prompt_ids)
        max_new = min(
            int(params.get("max_tokens") or params.get("max_new_tokens") or self.config.response_length), room
        )
        if max_new < 1:
            raise ValueError(
                f"rollout '{ROLLOUT_NAME}': a prompt of {len(prompt_ids)} tokens leaves no room to generate"
            )
        if seed is not None:
            torch.manual_seed(seed)
        out = self.model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=top_k if top_k > 0 else None,
            top_p=top_p if temperature > 0 else None,
            max_new_tokens=max_new,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt_ids) :]
        log_probs = None
        if params.get("logprobs"):
            # raw logits: the log-probs of the distribution the trainer computes (logits / temperature)
            logits = torch.stack(out.logits, dim=1)[0].float()
            logits = logits / temperature if temperature > 0 else logits
            log_probs = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1).tolist()
        return TokenOutput(
            token_ids=tokens.tolist(),
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    async def update_weights(
        self, state: dict[str, torch.Tensor], global_steps: int | None = None, peft_config: dict | None = None
    ) -> None:
        """Full weights, or with `peft_config` a LoRA adapter's weights (verl's merge=False sync) that the
        model then generates with."""
        async with self._lock:
            if peft_config is None:
                self._load_base(state)
            else:
                self._load_adapter(state, peft_config)
            if global_steps is not None:
                self.global_steps = global_steps

    def _load_base(self, state: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        weights = to_model_layout(state, own)
        base = {name for name in own if ".lora_" not in name}  # an adapter's weights come in their own sync
        missing = sorted(plain_name(n) for n in base - set(weights) if plain_name(n) not in self._tied_names())
        if missing:
            raise KeyError(f"rollout '{ROLLOUT_NAME}': the trainer sent no weights for {missing[:5]}")
        self.model.load_state_dict(weights, strict=False)

    def _load_adapter(self, state: dict[str, torch.Tensor], peft_config: dict) -> None:
        from peft import PeftModel, get_peft_config, get_peft_model, set_peft_model_state_dict

        if not isinstance(self.model, PeftModel):  # the first adapter: wrap the model as the trainer's is
            self.model = get_peft_model(self.model, get_peft_config(dict(peft_config))).eval()
        result = set_peft_model_state_dict(self.model, state)
        if result.unexpected_keys:
            raise KeyError(
                f"rollout '{ROLLOUT_NAME}': the trainer sent adapter weights the rollout model does not "
                f"have: {sorted(result.unexpected_keys)[:5]}"
            )

    def _tied_names(self) -> set[str]:
        return {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # verl's control calls: no device memory to free or restore, no in-flight batch to abort
    async def sleep(self, *args, **kwargs) -> None:
        return None

    async def wake_up(self, *args, **kwargs) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def server_name(replica_rank: int) -> str:
    return f"odc_hf_rollout_server_{replica_rank}"


class HFReplica(RolloutReplica):
    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        if self.is_reward_model or self.is_teacher_model:
            raise NotImplementedError(f"rollout '{ROLLOUT_NAME}' serves the policy only, not a reward or teacher model")
        if not self.workers:
            raise NotImplementedError(f"rollout '{ROLLOUT_NAME}' runs colocated with the trainer (hybrid engine) only")
        node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        server = (
            ray.remote(HFRolloutServer)
            .options(
                name=server_name(self.replica_rank),
                max_concurrency=self.max_concurrency,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
            )
            .remote(self.config, self.model_config, self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_name(self.replica_rank)


class HFServerAdapter(BaseRollout):
    """The training rank's end of rollout `hf`: forwards the trainer's weights to its replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ["RANK"])
        replica_world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // replica_world if replica_rank == -1 else replica_rank
        self.is_leader = rank % replica_world == 0

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights,
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config: dict | None = None,
        base_sync_done: bool = True,
        **kwargs,
    ):
        """verl's weight sync: full weights (peft_config None), or for LoRA with merge=False first the base
        weights (base_sync_done False) and from then on the adapter's (peft_config, base_sync_done True)."""
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"rollout '{ROLLOUT_NAME}' takes full weights (wire_format named_tensors), got {wire_format!r}"
            )
        # Every rank drains the generator: producing each full tensor is a collective over the trainer ranks.
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if self.is_leader:
            adapter = peft_config if base_sync_done else None
            await ray.get_actor(server_name(self.replica_rank)).update_weights.remote(state, global_steps, adapter)
