"""The demo's mini-batches: GRPO-like rollouts or long-context SFT samples, and the loss trained on them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..balance import load_lengths, rl_math_like, sft_long_context_like
from ..models import next_token_logprobs, split_next_token_logprobs
from .config import DemoConfig


@dataclass(frozen=True)
class Sample:
    prompt_len: int
    response_len: int
    advantage: float
    seed: int  # the tokens are drawn from this, so every row sees the same tokens wherever it lands

    @property
    def total(self) -> int:
        return self.prompt_len + self.response_len

    def stand_in(self, factor: int) -> Sample:
        """The same sample, `factor` times shorter: what the model computes on when compute is emulated."""
        if factor == 1:
            return self
        return dataclasses.replace(
            self,
            prompt_len=max(1, round(self.prompt_len / factor)),
            response_len=max(1, round(self.response_len / factor)),
        )


def _lengths(cfg: DemoConfig, step: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    n = cfg.samples_per_minibatch
    if cfg.lengths:
        # a file gives whole-sample lengths; a quarter of each (at most the prompt cap) is prompt
        file_lengths = load_lengths(cfg.lengths)
        picks = torch.randint(0, len(file_lengths), (n,), generator=g).tolist()
        cap = cfg.max_token_len if cfg.workload == "sft" else cfg.max_prompt_length + cfg.max_response_length
        totals = [min(file_lengths[i], cap) for i in picks]
        prompts = [min(cfg.max_prompt_length, max(1, t // 4)) for t in totals]
        return prompts, [max(1, t - p) for t, p in zip(totals, prompts)]
    seed = cfg.seed * 1000 + step
    if cfg.workload == "sft":
        # chats around 1/32 of the longest sample, documents from 1/8 of it up (the planner's
        # defaults at 32k: 1k-token chats, 4k to 32k-token documents)
        sample = sft_long_context_like(
            n,
            max_length=cfg.max_token_len,
            chat_median=cfg.max_token_len / 32,
            long_min=cfg.max_token_len // 8,
            seed=seed,
        )
        return sample.prompt_lens, sample.response_lens
    sample = rl_math_like(
        n, max_prompt_length=cfg.max_prompt_length, max_response_length=cfg.max_response_length, seed=seed
    )
    # GRPO: the responses of one prompt share it
    return [sample.prompt_lens[i - i % cfg.group_size] for i in range(n)], sample.response_lens


def draw_minibatches(cfg: DemoConfig) -> list[list[Sample]]:
    """RL: groups of responses per prompt, group-normalized rewards as advantages. SFT: advantage 1,
    which makes the policy loss the response tokens' negative log-likelihood."""
    g = torch.Generator().manual_seed(cfg.seed)
    n = cfg.samples_per_minibatch
    batches = []
    for step in range(cfg.steps):
        prompts, responses = _lengths(cfg, step, g)
        if cfg.workload == "rl":
            rewards = torch.randint(0, 2, (n,), generator=g).float().view(-1, cfg.group_size)
            adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        else:
            adv = torch.ones(n)
        batches.append([Sample(prompts[i], responses[i], float(adv[i]), step * n + i) for i in range(n)])
    return batches


def sample_tokens(sample: Sample, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sample.seed)
    return torch.randint(0, vocab, (sample.total,), generator=g)


def policy_loss(model, samples: list[Sample], vocab: int, global_response_tokens: int, world: int):
    """-advantage * log p(response token), token-mean over the mini-batch's response tokens (verl's
    global normalization, times the data-parallel size that FSDP's mean divides out)."""
    logps = next_token_logprobs(model, [sample_tokens(s, vocab) for s in samples])
    total = sum(-s.advantage * logp[s.prompt_len - 1 :].sum() for s, logp in zip(samples, logps))
    return total / global_response_tokens * world


def split_policy_loss(model, sample: Sample, vocab: int, global_response_tokens: int, world: int, member):
    """policy_loss of one sample split over a block of ranks (odc_plugin.fsdp.ulysses), on this member: its
    slice's response tokens; the members' losses sum to the sample's."""
    logp, positions = split_next_token_logprobs(model, sample_tokens(sample, vocab), member)
    response = (positions >= sample.prompt_len - 1) & (positions < sample.total - 1)
    return -sample.advantage * logp[response].sum() / global_response_tokens * world
