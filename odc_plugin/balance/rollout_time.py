"""How long a GPU inference server (vLLM's continuous batching) takes to generate a step's responses.

A decode step generates one token of every running sequence; it reads the weights once and every running
sequence's KV cache, and computes a token's FLOPs per sequence, so on a GPU it lasts

    step_overhead_s + max(weight bytes + KV bytes of the running contexts) / memory_bw,
                          running sequences * FLOPs per token / flops)

and admitting a request adds its prompt's prefill (its tokens' FLOPs) to the step that admits it. At most
`max_running` sequences run at once (vLLM's max_num_seqs); the others wait, first come first served. So a
rollout's long tail costs what it costs on GPUs: its last responses run almost alone, each step paying the
weights' read for a handful of tokens.

`DecodeModel.load` reads a decode fit file (configs/cost_fit/*-decode.json) whose numbers come from
published sources it names; `DecodeClock` runs the model over requests as they arrive (the emulated `hf`
rollout holds each response until its modelled finish); `rollout_seconds` is a synchronous rollout (every
request at once) and the time until a given number of responses have finished (a partial rollout).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DecodeModel:
    """One inference server's decode and prefill times (one replica: its GPUs together)."""

    weight_bytes: float
    """Bytes of weights a decode step reads (the model's parameters in the rollout's dtype)."""
    kv_bytes_per_token: float
    """KV-cache bytes a decode step reads per token of a running sequence's context."""
    flops_per_token: float
    """FLOPs to compute one token (forward only): a decode step's per sequence, a prefill's per prompt token."""
    memory_bw: float
    """Achieved memory bandwidth, bytes/s."""
    flops: float
    """Achieved FLOP/s of decode and prefill."""
    step_overhead_s: float = 0.0
    """Seconds of each decode step outside the GPU's work (scheduling, sampling, launches)."""
    max_running: int = 256
    """Sequences decoded at once (vLLM's max_num_seqs; verl's rollout default 256)."""

    def __post_init__(self):
        values = (self.weight_bytes, self.kv_bytes_per_token, self.flops_per_token, self.step_overhead_s)
        if min(values) < 0 or not (self.memory_bw > 0 and self.flops > 0) or self.max_running < 1:
            raise ValueError(
                "DecodeModel needs bytes, FLOPs and overhead >= 0, memory_bw and flops > 0 and max_running >= 1"
            )

    def step_seconds(self, running: int, context_tokens: int) -> float:
        """One decode step of `running` sequences holding `context_tokens` tokens of context together."""
        memory = (self.weight_bytes + self.kv_bytes_per_token * context_tokens) / self.memory_bw
        return self.step_overhead_s + max(memory, running * self.flops_per_token / self.flops)

    def prefill_seconds(self, tokens: int) -> float:
        return tokens * self.flops_per_token / self.flops

    @classmethod
    def load(cls, path: str | Path, max_running: int | None = None) -> DecodeModel:
        """A decode fit file: its `model` entry holds this class's fields (its `sources` say where each
        number comes from); `max_running` overrides the file's."""
        try:
            fields = json.loads(Path(path).read_text())["model"]
            model = cls(**fields)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a decode fit file ({type(e).__name__}: {e})") from None
        return model if max_running is None else cls(**{**fields, "max_running": max_running})


@dataclass
class _Request:
    prompt: int
    response: int
    finished_s: float | None = None


@dataclass
class DecodeClock:
    """One server's continuous batching, run on the model's clock (seconds from its start) as requests
    arrive: `admit` a request at a time, `advance` the clock, read when each finished."""

    model: DecodeModel
    now: float = 0.0
    _steps: int = 0
    _context: int = 0  # tokens of context of the running sequences together
    _prefill_s: float = 0.0  # prefill of the requests joining the next step
    _running: list = field(default_factory=list)  # heap of (finishing step, request id)
    _waiting: list = field(default_factory=list)  # request ids, first come first served
    _requests: list = field(default_factory=list)

    def admit(self, prompt_tokens: int, response_tokens: int) -> int:
        """A request arriving now; returns its id."""
        if prompt_tokens < 0 or response_tokens < 1:
            raise ValueError(f"a request needs >= 0 prompt, >= 1 response tokens: {prompt_tokens}, {response_tokens}")
        self._requests.append(_Request(int(prompt_tokens), int(response_tokens)))
        self._waiting.append(len(self._requests) - 1)
        return len(self._requests) - 1

    def finished(self, request: int) -> float | None:
        """When the request's last token was generated (the model's seconds), or None while it runs."""
        return self._requests[request].finished_s

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    def _start_waiting(self) -> None:
        """The waiting requests that fit join the next step, their prefill with them."""
        while self._waiting and len(self._running) < self.model.max_running:
            rid = self._waiting.pop(0)
            r = self._requests[rid]
            heapq.heappush(self._running, (self._steps + r.response, rid))
            self._context += r.prompt
            self._prefill_s += self.model.prefill_seconds(r.prompt)

    def _next_step_s(self) -> float:
        return self._prefill_s + self.model.step_seconds(len(self._running), self._context)

    def step(self) -> None:
        """One decode step: every running sequence gains a token, those at their length finish."""
        self._start_waiting()
        if not self._running:
            return
        self.now += self._next_step_s()
        self._prefill_s = 0.0
        self._steps += 1
        self._context += len(self._running)
        while self._running and self._running[0][0] == self._steps:
            _, rid = heapq.heappop(self._running)
            r = self._requests[rid]
            r.finished_s = self.now
            self._context -= r.prompt + r.response

    def advance(self, until_s: float) -> None:
        """Run the steps that end by `until_s`; an idle server's clock moves on to it."""
        while True:
            self._start_waiting()
            if not self._running:
                self.now = max(self.now, until_s)
                return
            if self.now + self._next_step_s() > until_s:
                return
            self.step()


@dataclass(frozen=True)
class RolloutTime:
    finished_s: tuple[float, ...]  # per request, when its last token came

    @property
    def seconds(self) -> float:
        """The whole rollout: its last response."""
        return max(self.finished_s, default=0.0)

    def until(self, count: int) -> float:
        """When `count` responses had finished (a partial rollout that stops there)."""
        if not 1 <= count <= len(self.finished_s):
            raise ValueError(f"count must be 1..{len(self.finished_s)}, got {count}")
        return sorted(self.finished_s)[count - 1]


def rollout_seconds(
    prompt_lens: Sequence[int], response_lens: Sequence[int], model: DecodeModel, servers: int = 1
) -> RolloutTime:
    """A synchronous rollout: every request at once, dealt round-robin over `servers` replicas (as verl's
    agent loop balances them), each its own continuous batch."""
    if len(prompt_lens) != len(response_lens) or servers < 1:
        raise ValueError("give one prompt length per response length and at least one server")
    clocks = [DecodeClock(model) for _ in range(servers)]
    ids = [clocks[i % servers].admit(p, r) for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]
    for clock in clocks:
        while clock.busy:
            clock.step()
    return RolloutTime(tuple(clocks[i % servers].finished(rid) for i, rid in enumerate(ids)))


def steady_seconds(
    prompt_lens: Sequence[int], response_lens: Sequence[int], model: DecodeModel, servers: int = 1
) -> float:
    """A rollout that never runs dry: its responses' tokens at the rate of full batches, as where unfinished
    responses carry over to the next step (colocate_async and separate_async's partial rollouts) and no long
    tail runs alone. A running sequence is met, on average, at the context prompt + E[r^2] / (2 E[r]) (a
    longer response is running for longer), with every server holding max_running of them (or the requests
    it has, if fewer)."""
    if len(prompt_lens) != len(response_lens) or not response_lens or servers < 1:
        raise ValueError("give one prompt length per response length, at least one, and at least one server")
    tokens = float(sum(response_lens))
    mean_prompt = sum(prompt_lens) / len(prompt_lens)
    context = mean_prompt + sum(r * r for r in response_lens) / (2 * tokens)
    running = min(model.max_running, -(-len(response_lens) // servers))
    rate = running / model.step_seconds(running, round(running * context))  # tokens per second per server
    prefill = model.prefill_seconds(sum(prompt_lens))
    return (tokens / rate + prefill) / servers
