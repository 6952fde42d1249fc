"""Agent loop `odc_cpu_multi_turn`: multi-turn trajectories for the CPU A/B, as verl's tool agent loop
builds them, without a tool server.

Each trajectory is one to MAX_TURNS assistant turns (as many as its prompt's hash says, the same in every
run); after every turn but the last an observation comes back as a tool's would (OBSERVATION, a user
message), merged into the trajectory with verl's own Continuous Token builder and masked out of the loss
(`response_mask` 0), so the trainer computes it and learns nothing from it. Select it with
`actor_rollout_ref.rollout.agent.default_agent_loop=odc_cpu_multi_turn`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

AGENT_NAME = "odc_cpu_multi_turn"
MAX_TURNS = 3
OBSERVATION = "The checker says: check the arithmetic once more."


def turns_of(prompt_ids: list[int]) -> int:
    """1..MAX_TURNS, from the prompt alone."""
    digest = hashlib.sha256(",".join(map(str, prompt_ids)).encode()).digest()
    return 1 + digest[0] % MAX_TURNS


@register(AGENT_NAME)
class MultiTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> AgentLoopOutput:
        response_length = self.rollout_config.response_length
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        response_mask: list[int] = []
        logprobs: list[float] = []
        metrics: dict[str, Any] = {"num_preempted": -1}
        turns, extra = turns_of(prompt_ids), {}
        for turn in range(turns):
            output = await self.server_manager.generate(
                request_id=f"det-{priority}-{turn}", prompt_ids=prompt_ids, sampling_params=sampling_params
            )
            extra = output.extra_fields
            merged, response_mask, logprobs = await self.ct_merge_assistant_token(
                prompt_ids,
                output.token_ids,
                response_mask,
                logprobs if (logprobs or output.log_probs) else None,
                assistant_logprobs=output.log_probs or None,
            )
            prompt_ids = merged.token_ids
            if turn == turns - 1 or len(response_mask) >= response_length:
                break
            previous = [*messages, {"role": "assistant", "content": self.tokenizer.decode(output.token_ids)}]
            messages = [*previous, {"role": "user", "content": OBSERVATION}]
            merged, response_mask, logprobs = await self.ct_merge_context_msg(
                previous, messages, prompt_ids, response_mask, logprobs or None
            )
            prompt_ids = merged.token_ids
        # the response is the trajectory's last len(response_mask) tokens, as verl's own loops cut it
        prompt_length = len(prompt_ids) - len(response_mask)
        output = AgentLoopOutput(
            prompt_ids=prompt_ids[:prompt_length],
            response_ids=prompt_ids[prompt_length:][:response_length],
            response_mask=response_mask[:response_length],
            response_logprobs=logprobs[:response_length] if logprobs else None,
            num_turns=2 * turns,
            metrics=metrics,
            extra_fields=extra,
        )
        output.extra_fields.update({"turn_scores": [], "tool_rewards": []})
        return output
