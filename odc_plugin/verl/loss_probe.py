"""Whether a role's configured loss gives the same update however a mini-batch is packed, decided by running it.

verl normalizes its losses by the whole mini-batch (`batch_num_tokens`, `global_batch_size`, `dp_size`), so the
gradient of a mini-batch does not depend on which samples share a micro-batch or a rank, as long as the loss
uses nothing else. A loss that normalizes by, selects from or draws at random over its own micro-batch (GMPO's
mean over the micro-batch's sequences, Clip-Cov's and KL-Cov's covariance of the micro-batch's tokens,
`seq-mean-token-sum-norm`'s padded width) trains something else when samples are packed otherwise, as they
are when LB-Mini moves samples between ranks and each rank packs its own micro-batches.

So instead of a list of losses (verl adds some in most releases, and users register their own), the probe
runs the role's own loss function, the one verl's engine calls per micro-batch (`ppo_loss` or `value_loss` of
`verl.workers.utils.losses`, with the configured policy loss from verl's registry, the entropy and KL terms and
the mini-batch's global batch info), on synthetic mini-batches of the run's shape packed two ways:

- as verl packs them: equal contiguous shares, cut into micro-batches of the run's size;
- shuffled, in uneven shares, cut into micro-batches of 1, 2, 3, ... samples;

and compares the gradients with respect to the log-probs (and entropies, or values), summed over every
micro-batch of every rank, over several seeds, each packing with its own random draws. This module knows verl's
losses only, nothing of ODC; `odc_plugin.verl.dispatch.check_losses` decides what to refuse.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# A probe's mini-batch is the run's, capped to keep the probe well under a second: the dependence it looks for
# shows at any size, and the shares and micro-batches need only be several and different.
MAX_RANKS = 8
MAX_SAMPLES = 64
MAX_PROMPT_LENGTH = 16
MAX_RESPONSE_LENGTH = 128
TRIALS = 3
# verl 0.9.1's loss_agg_mode choices (ActorConfig.__post_init__ accepts these; the critic's agg_loss too).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Relative to the largest gradient: float64 sums taken in another order differ by ~1e-15, a loss that depends
# on the packing by the share of one token or more.
RTOL = 1e-9


@dataclass(frozen=True)
class ProbeShape:
    """The run's shape of one role's mini-batch, as far as the probe uses it."""

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
    """Tokens per micro-batch with dynamic batch sizes (`ppo_max_token_len_per_gpu`)."""


@dataclass(frozen=True)
class Verdict:
    """What a probe found."""

    invariant: bool
    """The summed gradients agreed to RTOL in every trial."""

    difference: float
    """The largest difference of a summed gradient between the two packings, over the largest gradient."""

    seconds: float
    """Wall time of the probe."""


def probe_actor_loss(config, shape: ProbeShape, trials: int = TRIALS, rollout_is_weights: bool = False) -> Verdict:
    """Probe verl's actor loss (`verl.workers.utils.losses.ppo_loss`) under the actor config `config` (an
    `ActorConfig`: `policy_loss.loss_mode`, `loss_agg_mode`, `loss_scale_factor`, `entropy_coeff`,
    `calculate_entropy`, `use_kl_loss`, `kl_loss_type`, ...); `rollout_is_weights`: the batch carries rollout
    correction's importance weights, as verl's trainer adds them with `algorithm.rollout_correction.rollout_is`."""
    from verl.workers.utils.losses import ppo_loss

    entropy = bool(config.calculate_entropy or config.entropy_coeff)
    # ppo_loss writes the mini-batch's global batch info into the config it is given
    config = copy.deepcopy(config)
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    return _probe(
        lambda model_output, data: ppo_loss(config, model_output, data)[0],
        outputs,
        (
            "old_log_probs",
            "advantages",
            *(("ref_log_prob",) if config.use_kl_loss else ()),
            *(("rollout_is_weights",) if rollout_is_weights else ()),
        ),
        shape,
        trials,
    )


def probe_critic_loss(config, shape: ProbeShape, trials: int = TRIALS) -> Verdict:
    """Probe verl's critic loss (`verl.workers.utils.losses.value_loss`) under the critic config `config`
    (a `CriticConfig`: `loss_agg_mode`, `loss_scale_factor`, `cliprange_value`)."""
    from verl.workers.utils.losses import value_loss

    return _probe(
        lambda model_output, data: value_loss(config, model_output, data)[0],
        ("values",),
        ("values", "returns"),
        shape,
        trials,
    )


def packings(shape: ProbeShape, seed: int) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """The two packings of a probe's mini-batch of `probe_size(shape)` samples: [rank][micro-batch] -> samples.

    The first as verl packs a mini-batch: equal contiguous shares, each cut in order into micro-batches of the
    run's micro-batch size (with dynamic batch sizes: as many of the longest samples as the budget holds). The
    second shuffled, in uneven shares (rank r's share grows with r), cut into micro-batches of 1, 2, 3, ...
    samples: other neighbours, other micro-batch sizes and counts, other ranks for every sample.
    """
    dp, n = _probe_ranks(shape), probe_size(shape)
    if shape.micro_batch_size is not None:
        per_micro = shape.micro_batch_size
    else:
        longest = _probe_prompt_length(shape) + _probe_response_length(shape)
        per_micro = max(1, (shape.max_token_len or longest) // longest)
    share = n // dp
    verl = [_cut(list(range(r * share, (r + 1) * share)), [per_micro]) for r in range(dp)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    weights = list(range(1, dp + 1))
    counts = [1 + (n - dp) * w // sum(weights) for w in weights]
    counts[-1] += n - sum(counts)
    starts = [sum(counts[:r]) for r in range(dp)]
    other = [_cut(order[s : s + c], [1, 2, 3]) for s, c in zip(starts, counts)]
    return verl, other


def probe_size(shape: ProbeShape) -> int:
    """Samples of a probe's mini-batch: the run's, capped, a whole number per rank and at least two each."""
    dp = _probe_ranks(shape)
    return max(2, min(shape.samples, MAX_SAMPLES) // dp) * dp


def _probe_ranks(shape: ProbeShape) -> int:
    return max(1, min(shape.dp_size, MAX_RANKS))


def _probe_prompt_length(shape: ProbeShape) -> int:
    return max(1, min(shape.max_prompt_length, MAX_PROMPT_LENGTH))


def _probe_response_length(shape: ProbeShape) -> int:
    # at least 2 tokens: responses of different lengths give micro-batches of different padded widths
    return max(2, min(shape.max_response_length, MAX_RESPONSE_LENGTH))


def _cut(samples: list[int], sizes: list[int]) -> list[list[int]]:
    """`samples` in order, in pieces whose sizes cycle through `sizes` (the last may be smaller)."""
    pieces, i = [], 0
    while i < len(samples):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(samples[i : i + size])
        i += size
    return pieces


def _probe(
    loss: Callable, outputs: tuple[str, ...], inputs: tuple[str, ...], shape: ProbeShape, trials: int
) -> Verdict:
    """Run `loss(model_output, data)` on both packings of `trials` synthetic mini-batches; `outputs` are the
    model outputs the loss differentiates (whose gradients are compared), `inputs` the per-token fields of
    the batch it reads besides the response mask."""
    start = time.perf_counter()
    worst = 0.0
    # the probe runs in the trainer's process: its draws must not move the trainer's random state
    with torch.random.fork_rng(devices=[]):
        for trial in range(trials):
            batch = _synthetic_batch(shape, outputs, inputs, seed=trial)
            grads = [
                _summed_gradients(loss, batch, packing, seed=2 * trial + p)
                for p, packing in enumerate(packings(shape, seed=trial))
            ]
            scale = max(max(g.abs().max().item() for g in grads[0]), 1e-30)
            worst = max(worst, max((a - b).abs().max().item() for a, b in zip(*grads)) / scale)
            if worst > RTOL:
                break
    return Verdict(invariant=worst <= RTOL, difference=worst, seconds=time.perf_counter() - start)


@dataclass(frozen=True)
class _Batch:
    """A synthetic mini-batch, per sample."""

    fields: dict[str, list[torch.Tensor]]  # what the loss reads: prompts, responses, response_mask, the inputs
    outputs: dict[str, list[torch.Tensor]]  # the model outputs, prompt + response long
    num_tokens: int  # response tokens in the loss (verl's batch_num_tokens)


def _synthetic_batch(shape: ProbeShape, outputs: tuple[str, ...], inputs: tuple[str, ...], seed: int) -> _Batch:
    """A mini-batch of float64 tensors that exercises every branch of verl's losses: responses of different
    lengths (one of the longest), a few masked tokens, log-probs whose ratios fall inside and outside the
    clip ranges, sequence-level advantages of both signs with token noise, values beyond the clip range."""
    g = torch.Generator().manual_seed(seed)

    def rand(size):
        return torch.rand(size, generator=g, dtype=torch.float64)

    def randn(size):
        return torch.randn(size, generator=g, dtype=torch.float64)

    n, max_response = probe_size(shape), _probe_response_length(shape)
    prompt_lengths = torch.randint(1, _probe_prompt_length(shape) + 1, (n,), generator=g).tolist()
    response_lengths = torch.randint(1, max_response + 1, (n,), generator=g).tolist()
    response_lengths[int(torch.randint(n, (1,), generator=g))] = max_response
    fields: dict[str, list[torch.Tensor]] = {key: [] for key in ("prompts", "responses", "response_mask", *inputs)}
    model: dict[str, list[torch.Tensor]] = {key: [] for key in outputs}
    for p, r in zip(prompt_lengths, response_lengths):
        fields["prompts"].append(torch.zeros(p, dtype=torch.long))
        fields["responses"].append(torch.zeros(r, dtype=torch.long))
        mask = (rand(r) > 0.1).long()
        mask[0] = 1
        fields["response_mask"].append(mask)
        old = -3 * rand(r)
        per_token = {
            "old_log_probs": old,
            "advantages": 2 * randn(1) + 0.5 * randn(r),
            "ref_log_prob": old + 0.1 * randn(r),
            "rollout_is_weights": 0.5 + rand(r),
            "values": randn(r),
            "returns": randn(r),
        }
        for key in inputs:
            fields[key].append(per_token[key])
        response = {
            "log_probs": old + 0.3 * randn(r),
            "entropy": 2 * rand(r),
            "values": per_token["values"] + 0.5 * randn(r),
        }
        # a model output covers prompt and response: verl's loss takes the response's positions, shifted by one
        for key in outputs:
            model[key].append(torch.cat([randn(p - 1), response[key], randn(1)]))
    return _Batch(fields, model, num_tokens=sum(int(m.sum()) for m in fields["response_mask"]))


def _summed_gradients(loss: Callable, batch: _Batch, packing: list[list[list[int]]], seed: int) -> list[torch.Tensor]:
    """The gradients of `loss` with respect to every model output of `batch`, summed over every micro-batch of
    every rank of `packing`, each micro-batch called as verl's engine calls the loss (samples as jagged nested
    tensors, the mini-batch's global batch info as non-tensor data)."""
    from verl.utils import tensordict_utils as tu

    torch.manual_seed(seed)
    leaves = {key: [t.clone().requires_grad_(True) for t in samples] for key, samples in batch.outputs.items()}
    samples = sum(len(micro) for rank in packing for micro in rank)
    info = {"dp_size": len(packing), "batch_num_tokens": batch.num_tokens, "global_batch_size": samples}
    for rank in packing:
        for micro in rank:
            data = tu.get_tensordict(
                {key: tu.nested_tensor_from_tensor_list([v[i] for i in micro]) for key, v in batch.fields.items()},
                info,
            )
            model_output = {key: tu.nested_tensor_from_tensor_list([v[i] for i in micro]) for key, v in leaves.items()}
            loss(model_output, data).backward()
    return [torch.cat([t.grad if t.grad is not None else torch.zeros_like(t) for t in v]) for v in leaves.values()]
