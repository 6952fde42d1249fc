"""Whether a role's configured loss gives the same update however odc packs a mini-batch, decided by running it.

verl normalizes its losses by the whole mini-batch (`batch_num_tokens`, `global_batch_size`, `dp_size`), so the
gradient of a mini-batch does not depend on which samples share a micro-batch or a rank, as long as the loss
uses nothing else. A loss that normalizes by, selects from or draws at random over its own micro-batch (GMPO's
mean over the micro-batch's sequences, Clip-Cov's and KL-Cov's covariance of the micro-batch's tokens,
`seq-mean-token-sum-norm`'s padded width) trains something else when samples are packed otherwise, as they
are when LB-Mini moves samples between ranks and each rank packs its own micro-batches.

So instead of a list of losses (verl adds some in most releases, and users register their own), the probe
runs the role's own loss function, the one verl's engine calls per micro-batch (`ppo_loss`, on-policy
distillation's `distillation_ppo_loss` or `value_loss`, with the configured losses from verl's registries,
the entropy and KL terms and the mini-batch's global batch info), on synthetic mini-batches of the run's
shape drawn like real RL data (`_synthetic_batch`), packed as fsdp2 packs them and as odc does (`packings`,
with verl's own packing functions), and compares the gradients with respect to the model's outputs, summed
over every micro-batch of every rank, over several trials, each packing with its own random draws. A loss that
raises, or whose gradient is not finite, cannot be compared: the verdict says so, never "invariant". This
module knows verl's losses and how the odc engine packs a share; `odc_plugin.verl.loss_check.check_losses`
decides what to refuse.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from odc_plugin.balance.common import chunk
from odc_plugin.balance.lb_micro import lockstep_micro_batches, verl_micro_batches

# A probe's mini-batch is the run's, capped to keep the probe near a second: the dependence it looks for shows
# at any size, and the shares and micro-batches need only be several and different. Sequences longer than
# MAX_SEQUENCE_LENGTH are scaled down, the token budget with them, so that verl packs them as the run's.
MAX_RANKS = 8
MAX_SAMPLES = 64
MAX_SEQUENCE_LENGTH = 4096
TRIALS = 3
# verl 0.9.1's loss_agg_mode choices (ActorConfig.__post_init__ accepts these; the critic's agg_loss too).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Relative to the largest gradient: float64 sums taken in another order differ by ~1e-15, a loss that depends
# on the packing by the share of one token or more.
RTOL = 1e-9
# The synthetic data's ranges (`_synthetic_batch`), named in a refusal of a loss whose gradient is not finite.
LOWEST_LOG_PROB = -20.0
ADVANTAGE_SCALES = (0.1, 1.0, 10.0)
DATA_RANGES = (
    f"log-probabilities from {LOWEST_LOG_PROB:g} to 0, advantages at scales {', '.join(map(str, ADVANTAGE_SCALES))} "
    f"and exactly 0, responses of 1 to thousands of tokens"
)


@dataclass(frozen=True)
class ProbeShape:
    """The run's shape of one role's mini-batch and how odc packs it, as far as the probe uses them."""

    dp_size: int
    """Data-parallel ranks of the role."""

    samples: int
    """Samples of one mini-batch over all ranks (`ppo_mini_batch_size * rollout.n`)."""

    max_prompt_length: int
    """`data.max_prompt_length`."""

    max_response_length: int
    """`data.max_response_length`."""

    micro_batch_size: int | None = None
    """Samples per micro-batch with a fixed micro-batch size; None with dynamic batch sizes."""

    max_token_len: int | None = None
    """Tokens per micro-batch with dynamic batch sizes (`ppo_max_token_len_per_gpu` times the Ulysses size)."""

    balancer: str = "lb_mini"
    """How odc shares a step's samples among ranks: `lb_mini` (uneven shares, any sample on any rank) or
    `lb_micro` (verl's equal shares, each rank packing its own number of micro-batches)."""

    per_token_advantages: bool = True
    """The run's advantages differ between a response's tokens (GAE); False: one per response (GRPO and verl's
    other outcome estimators, `advantages_per_token`)."""


@dataclass(frozen=True)
class Verdict:
    """What a probe found."""

    invariant: bool
    """The summed gradients agreed to RTOL in every trial."""

    difference: float
    """The largest difference of a summed gradient between the two packings, over the largest gradient (nan
    when the loss could not be compared)."""

    seconds: float
    """Wall time of the probe."""

    failure: str | None = None
    """Why the loss could not be compared (it raised, or its gradient is not finite); None when it was."""


def probe_actor_loss(
    config, shape: ProbeShape, trials: int = TRIALS, rollout_is_weights: bool = False, distillation=None
) -> Verdict:
    """Probe verl's actor loss under the actor config `config` (an `ActorConfig`: `policy_loss.loss_mode`,
    `loss_agg_mode`, `loss_scale_factor`, `entropy_coeff`, `calculate_entropy`, `use_kl_loss`, `kl_loss_type`,
    ...): `verl.workers.utils.losses.ppo_loss`, or with `distillation` (a `DistillationConfig`, on-policy
    distillation on) `verl.trainer.distillation.distillation_ppo_loss`; `rollout_is_weights`: the batch carries
    rollout correction's importance weights, as verl's trainer adds them with `algorithm.rollout_correction`."""
    from verl.workers.utils.losses import ppo_loss

    entropy = bool(config.calculate_entropy or config.entropy_coeff)
    # the losses write the mini-batch's global batch info into the configs they are given
    config, distillation = copy.deepcopy(config), copy.deepcopy(distillation)
    outputs, sequence_inputs = ["log_probs", *(["entropy"] if entropy else [])], []
    if distillation is None:
        loss = ppo_loss
    else:
        from verl.trainer.distillation import distillation_ppo_loss

        def loss(config, model_output, data):
            return distillation_ppo_loss(config, distillation, model_output, data)

        if distillation.distillation_loss.loss_settings.use_topk:
            # computed per token from the student's logits before the loss (verl's logits processor)
            outputs += ["distillation_losses", "student_mass", "teacher_mass"]
        else:
            sequence_inputs.append("teacher_logprobs")
    inputs = [
        "old_log_probs",
        "advantages",
        *(["ref_log_prob"] if config.use_kl_loss else []),
        *(["rollout_is_weights"] if rollout_is_weights else []),
    ]
    return _probe(
        lambda model_output, data: loss(config, model_output, data)[0],
        _Fields(tuple(outputs), tuple(inputs), tuple(sequence_inputs)),
        shape,
        trials,
    )


def probe_critic_loss(config, shape: ProbeShape, trials: int = TRIALS) -> Verdict:
    """Probe verl's critic loss (`verl.workers.utils.losses.value_loss`) under the critic config `config`
    (a `CriticConfig`: `loss_agg_mode`, `loss_scale_factor`, `cliprange_value`)."""
    from verl.workers.utils.losses import value_loss

    return _probe(
        lambda model_output, data: value_loss(config, model_output, data)[0],
        _Fields(("values",), ("values", "returns"), ()),
        shape,
        trials,
    )


def advantages_per_token(algorithm, group_size: int) -> bool:
    """Whether the run's advantage estimator (`algorithm.adv_estimator`, of verl's registry or registered with
    `register_adv_est`) gives a response's tokens different advantages, as GAE does; GRPO, RLOO and verl's other
    outcome estimators give a response one. Found by running verl's `compute_advantage` as the trainer calls it
    on a few groups of `group_size` responses (`rollout.n`) with outcome rewards; an estimator that cannot run on
    them (it needs inputs they lack) counts as per token, the case under which the probe refuses more."""
    import numpy as np
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    g = torch.Generator().manual_seed(0)
    n, width = 3 * group_size, 8
    lengths = torch.randint(2, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(n, width)
    rewards[torch.arange(n), lengths - 1] = torch.randint(0, 2, (n,), generator=g).float()
    if algorithm.get("use_kl_in_reward"):
        rewards -= 0.01 * torch.rand(n, width, generator=g) * mask  # the trainer's per-token KL penalty
    batch = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": torch.randn(n, width, generator=g),
        "reward_baselines": torch.rand(n, generator=g),
        "old_log_probs": -torch.rand(n, width, generator=g),
        "sum_pi_squared": torch.rand(n, width, generator=g),
    }
    uid = np.array([str(i // group_size) for i in range(n)], dtype=object)
    try:
        data = compute_advantage(
            DataProto.from_dict(tensors=batch, non_tensors={"uid": uid}),
            adv_estimator=algorithm.adv_estimator,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
            num_repeat=group_size,
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
            config=algorithm,
        )
    except Exception:  # an estimator needing what this batch lacks: assume the general case
        return True
    advantages, mask = data.batch["advantages"].double(), data.batch["response_mask"].bool()
    first = advantages[:, :1].expand_as(advantages)
    return bool(((advantages - first).abs() > 1e-6 * (1 + first.abs()))[mask].any())


def packings(shape: ProbeShape, lengths: list[int], seed: int) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """fsdp2's and odc's packing of a probe's mini-batch of these sequence lengths (prompt and response):
    [rank][micro-batch] -> samples, each cut with verl's own functions as the engines cut a share.

    fsdp2's: equal contiguous shares of the batch in its order, here longest first (verl dispatches contiguous
    chunks, and nothing balances one mini-batch's shares: with `trainer.balance_batch=False`, say), each cut in
    order into micro-batches of the run's fixed size, or under the token budget into as many as the busiest rank
    needs (`lockstep_micro_batches`; longest first makes the ranks' own counts differ most). odc's: under LB-Mini
    uneven shares of shuffled samples (LB-Mini may put any sample on any rank; rank r's share grows with r),
    under `lb_micro` fsdp2's shares; each cut as the odc engine cuts a share: in order into pieces of the fixed
    size and a smaller last one, or under the budget into as many as it needs itself (`verl_micro_batches`).
    With a fixed size of 1 both put every sample in a micro-batch of its own, whatever rank runs it.
    """
    dp, n, size, budget = _probe_ranks(shape), len(lengths), shape.micro_batch_size, _probe_budget(shape)
    longest_first = sorted(range(n), key=lambda s: (-lengths[s], s))
    per_rank = n // dp
    shares = [sorted(longest_first[r * per_rank : (r + 1) * per_rank]) for r in range(dp)]
    if size is None:
        fsdp2 = lockstep_micro_batches(lengths, shares, budget)
    else:
        fsdp2 = [chunk(share, size) for share in shares]
    if shape.balancer == "lb_mini":
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        weights = list(range(1, dp + 1))
        counts = [1 + (n - dp) * w // sum(weights) for w in weights]
        counts[-1] += n - sum(counts)
        starts = [sum(counts[:r]) for r in range(dp)]
        # in verl's order within the step, as LB-Mini's plan keeps a share's samples
        shares = [sorted(order[s : s + c]) for s, c in zip(starts, counts)]
    if size is not None:
        return fsdp2, [chunk(share, size) for share in shares]
    own = [verl_micro_batches([lengths[s] for s in share], budget) for share in shares]
    return fsdp2, [[[share[i] for i in micro] for micro in micro_batches] for share, micro_batches in zip(shares, own)]


def probe_size(shape: ProbeShape) -> int:
    """Samples of a probe's mini-batch: the run's, capped, a whole number per rank, at least two each, and with a
    fixed micro-batch size whole micro-batches each (verl cuts a share into micro-batches of that size)."""
    dp, size = _probe_ranks(shape), shape.micro_batch_size
    per_rank = max(2, min(shape.samples, MAX_SAMPLES) // dp)
    if size is not None:
        per_rank = max(size, per_rank // size * size)
    return per_rank * dp


def _probe_ranks(shape: ProbeShape) -> int:
    return max(1, min(shape.dp_size, MAX_RANKS))


def _length_scale(shape: ProbeShape) -> float:
    return min(1.0, MAX_SEQUENCE_LENGTH / (shape.max_prompt_length + shape.max_response_length))


def _probe_budget(shape: ProbeShape) -> int | None:
    """The token budget of a probe's micro-batch: the run's, scaled as its sequences are."""
    return None if shape.max_token_len is None else max(2, int(shape.max_token_len * _length_scale(shape)))


@dataclass(frozen=True)
class _Fields:
    """What a loss reads of a micro-batch besides its prompts, responses and response mask."""

    outputs: tuple[str, ...]  # model outputs, prompt + response long: the leaves whose gradients are compared
    inputs: tuple[str, ...]  # per response token
    sequence_inputs: tuple[str, ...]  # per prompt + response token, as model outputs are laid out


def _probe(loss: Callable, fields: _Fields, shape: ProbeShape, trials: int) -> Verdict:
    """Run `loss(model_output, data)` on both packings of `trials` synthetic mini-batches."""
    start = time.perf_counter()
    worst = 0.0
    threads = torch.get_num_threads()
    # the probe runs in the trainer's process: its draws must not move the trainer's random state
    with torch.random.fork_rng(devices=[]):
        # micro-batches of a few thousand elements: threads only wait for each other (25x slower on 2 busy cores)
        torch.set_num_threads(1)
        try:
            for trial in range(trials):
                difference, failure = _trial(loss, fields, shape, trial)
                if failure is not None:
                    return Verdict(False, math.nan, time.perf_counter() - start, failure)
                worst = max(worst, difference)
                if worst > RTOL:
                    break
        finally:
            torch.set_num_threads(threads)
    return Verdict(invariant=worst <= RTOL, difference=worst, seconds=time.perf_counter() - start)


def _trial(loss: Callable, fields: _Fields, shape: ProbeShape, trial: int) -> tuple[float, str | None]:
    """The difference between the packings' summed gradients in one trial, over the largest; or why the loss
    could not be compared. A loss that cannot run a micro-batch without a valid token (verl's bypass_mode
    raises) is compared on responses that all have one: a fully masked response alone in a micro-batch would
    fail it under fsdp2 as well."""
    for fully_masked in (True, False):
        batch = _synthetic_batch(shape, fields, trial, fully_masked)
        grads, failure = [], None
        for p, packing in enumerate(packings(shape, batch.lengths, seed=trial)):
            summed, failure = _summed_gradients(loss, batch, packing, seed=2 * trial + p)
            if failure is not None:
                break
            grads.append(summed)
        if failure is None:
            return (grads[0] - grads[1]).abs().max().item() / max(grads[0].abs().max().item(), 1e-30), None
    return math.nan, failure


@dataclass(frozen=True)
class _Batch:
    """A synthetic mini-batch, per sample."""

    fields: dict[str, list[torch.Tensor]]  # what the loss reads: prompts, responses, response_mask, the inputs
    outputs: dict[str, list[torch.Tensor]]  # the model outputs, prompt + response long
    lengths: list[int]  # prompt + response tokens, by which verl packs under a token budget
    num_tokens: int  # response tokens in the loss (verl's batch_num_tokens)


def _synthetic_batch(shape: ProbeShape, fields: _Fields, seed: int, fully_masked: bool) -> _Batch:
    """A float64 mini-batch drawn like real RL data where losses differ: responses from 1 token to the longest
    (log-uniform), one fully masked if `fully_masked`, a few masked tokens elsewhere; log-probabilities at or
    below 0, most near it, a long tail down to LOWEST_LOG_PROB, new ones off the old by ratios inside and
    outside the clip ranges; advantages of every scale of ADVANTAGE_SCALES, some exactly 0 (a group of equal
    rewards), one per response or per token (`shape.per_token_advantages`); entropies, values and returns of
    several scales."""
    g = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.rand(size, generator=g, dtype=torch.float64)

    def randn(*size):
        return torch.randn(size, generator=g, dtype=torch.float64)

    def log_uniform(low, high, *size):
        return torch.exp(math.log(low) + (math.log(high) - math.log(low)) * rand(*size))

    def log_prob_like(reference, spread):
        # a log-probability near `reference`, still at or below 0
        return -(reference + spread * randn(*reference.shape)).abs()

    n = probe_size(shape)
    # the run's lengths, scaled: at least 2 response tokens, so that micro-batches differ in padded width
    scale, budget = _length_scale(shape), _probe_budget(shape)
    longest_prompt = max(1, int(shape.max_prompt_length * scale))
    longest = max(2, int(shape.max_response_length * scale))
    if budget is not None:  # verl's budget holds every sequence
        longest_prompt = min(longest_prompt, budget // 2)
        longest = min(longest, budget - longest_prompt)
    prompt_lengths = torch.randint(1, longest_prompt + 1, (n,), generator=g).tolist()
    response_lengths = log_uniform(1, longest + 1, n).long().clamp(1, longest).tolist()
    special = torch.randperm(n, generator=g).tolist()
    response_lengths[special[0]] = longest
    response_lengths[special[1 % n]] = 1
    scales = [ADVANTAGE_SCALES[k] for k in torch.randint(len(ADVANTAGE_SCALES), (n,), generator=g).tolist()]
    data: dict[str, list[torch.Tensor]] = {
        key: [] for key in ("prompts", "responses", "response_mask", *fields.inputs, *fields.sequence_inputs)
    }
    model: dict[str, list[torch.Tensor]] = {key: [] for key in fields.outputs}
    for i, (p, r, scale) in enumerate(zip(prompt_lengths, response_lengths, scales)):
        data["prompts"].append(torch.zeros(p, dtype=torch.long))
        data["responses"].append(torch.zeros(r, dtype=torch.long))
        mask = (rand(r) > 0.1).long()
        mask[0] = 1
        if fully_masked and i == special[2 % n]:  # one response fully masked (rejected by rollout correction, say)
            mask.zero_()
        data["response_mask"].append(mask)
        old = -log_uniform(0.01, -LOWEST_LOG_PROB, r)
        advantages = torch.full((r,), 0.0 if rand(1).item() < 0.2 else scale * randn(1).item(), dtype=torch.float64)
        if shape.per_token_advantages:
            advantages += 0.5 * scale * randn(r)
        returns = scale * randn(r)
        values = returns + 0.5 * scale * randn(r)
        per_token = {
            "old_log_probs": old,
            "advantages": advantages,
            "ref_log_prob": log_prob_like(old, 0.1),
            "rollout_is_weights": torch.exp(0.5 * randn(r)).clamp(max=2.0),
            "values": values,
            "returns": returns,
        }
        for key in fields.inputs:
            data[key].append(per_token[key])
        response = {
            "log_probs": log_prob_like(old, 0.3),
            "entropy": log_uniform(1e-3, 10.0, r),
            "values": values + 0.5 * scale * randn(r),
            "distillation_losses": log_uniform(1e-3, 10.0, r),
            "student_mass": 0.5 + 0.5 * rand(r),
            "teacher_mass": 0.5 + 0.5 * rand(r),
            "teacher_logprobs": log_prob_like(old, 1.0),
        }
        # laid out as a model output, over prompt and response: verl's loss takes the response's positions,
        # shifted by one
        for key in fields.sequence_inputs:
            data[key].append(torch.cat([-rand(p - 1), response[key], -rand(1)])[:, None])
        for key in fields.outputs:
            model[key].append(torch.cat([randn(p - 1), response[key], randn(1)]))
    return _Batch(
        data,
        model,
        lengths=[p + r for p, r in zip(prompt_lengths, response_lengths)],
        num_tokens=sum(int(m.sum()) for m in data["response_mask"]),
    )


def _summed_gradients(
    loss: Callable, batch: _Batch, packing: list[list[list[int]]], seed: int
) -> tuple[torch.Tensor | None, str | None]:
    """The gradients of `loss` with respect to every model output of `batch`, summed over every micro-batch of
    every rank of `packing`, each micro-batch called as verl's engine calls the loss (samples as jagged nested
    tensors, the mini-batch's global batch info as non-tensor data); and why they could not be had, if so."""
    from verl.utils import tensordict_utils as tu

    torch.manual_seed(seed)
    leaves = {key: [t.clone().requires_grad_(True) for t in samples] for key, samples in batch.outputs.items()}
    samples = sum(len(micro) for rank in packing for micro in rank)
    info = {"dp_size": len(packing), "batch_num_tokens": batch.num_tokens, "global_batch_size": samples}
    for rank in packing:
        for micro in rank:
            data = tu.get_tensordict(
                # ragged over tokens: a sequence input's samples are (tokens, 1)
                {
                    key: tu.nested_tensor_from_tensor_list([v[i] for i in micro], ragged_idx=1)
                    for key, v in batch.fields.items()
                },
                info,
            )
            model_output = {key: tu.nested_tensor_from_tensor_list([v[i] for i in micro]) for key, v in leaves.items()}
            # a loss may need what the trainer's process lacks (a GPU, a process group), or be wrong
            try:
                loss(model_output, data).backward()
            except Exception as e:
                text = " ".join(str(e).split())
                return None, f"it raised {type(e).__name__}{': ' + text[:200] if text else ''}"
    summed = torch.cat([t.grad if t.grad is not None else torch.zeros_like(t) for v in leaves.values() for t in v])
    if not torch.isfinite(summed).all():
        return None, f"its gradient is not finite on synthetic data drawn like a real batch ({DATA_RANGES})"
    return summed, None
