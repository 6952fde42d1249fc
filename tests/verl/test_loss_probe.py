"""The loss probe (odc_plugin/verl/loss_probe.py) and the refusal it decides (odc_plugin.verl.loss_check.check_losses,
called by the patched `PPOTrainer.init`).

* every policy loss in verl 0.9.1's registry under every `loss_agg_mode` verl accepts (and
  `seq-mean-token-sum-norm` with a `loss_scale_factor`): the probe's verdict is what a direct computation
  written here finds, calling the registered function itself on padded micro-batches of two packings of its
  own; the losses known to depend on the packing (GMPO, Clip-Cov, KL-Cov) are found to, in every mode;
* the critic's value loss under every `loss_agg_mode`, the same way;
* docs/verl.md's loss table is what the probe finds (tests/verl/loss_table.py writes it);
* the probe's data and packings: log-probabilities at or below 0 down to -20, advantages of size 10, fully masked
  and long responses, so that a loss whose dependence on the packing shows only there is refused; the packings
  odc runs (micro-batches of one sample stay one sample: GMPO, Clip-Cov with GRPO's advantages and KL-Cov pass);
* a loss that raises or whose gradient is not finite is refused in one line, never found invariant; a role that
  packs as fsdp2 is not probed at all;
* the trainer's entry refuses geo_mean, clip_cov and kl_cov (and the critic's unscaled
  `seq-mean-token-sum-norm`) at start, in one line naming the key and the settings that would fix it, before
  anything else starts;
* losses a user registers with `register_policy_loss` or `register_distillation_loss`: one normalizing by its
  own micro-batch is refused, one using verl's `agg_loss` passes, and verl's real engines on 2 gloo ranks show
  why: under odc's uneven shares the first trains other weights than under fsdp2, the second the same;
* the probe leaves the caller's random state alone.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, get_policy_loss_fn, register_policy_loss

from odc_plugin.verl.dispatch import ACTOR
from odc_plugin.verl.loss_check import check_losses
from odc_plugin.verl.loss_probe import (
    DATA_RANGES,
    LOSS_AGG_MODES,
    advantages_per_token,
    packings,
    probe_actor_loss,
)
from odc_plugin.verl.ppo_config import compose
from tests.verl import harness as H
from tests.verl import loss_table
from tests.verl.dispatch_ranks import SGD
from tests.verl.loss_table import SHAPE
from tests.verl.loss_table import actor_config as _actor_config
from tests.verl.requires import needs_transfer_queue as needs_tq

# The aggregations a mode is tested under: verl's, and seq-mean-token-sum-norm with a loss_scale_factor.
AGGREGATIONS = [(mode, None) for mode in LOSS_AGG_MODES] + [("seq-mean-token-sum-norm", loss_table.FACTOR)]
# Losses whose gradient depends on the micro-batch's own samples, whatever the aggregation.
PACKING_DEPENDENT = ("geo_mean", "clip_cov", "kl_cov")
DIRECT_RTOL = 1e-9  # float64, as the probe's


# ---------------------------------------------------------------------------------------------
# a direct two-packing computation, independent of the probe
# ---------------------------------------------------------------------------------------------


def _direct_batch(seed: int, n: int = 12, max_response: int = 20) -> dict[str, list[torch.Tensor]]:
    """Per sample, response-long float64 tensors: old and new log-probs, advantages, a mask with holes,
    values, returns, predicted values."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(2, max_response + 1, (n,), generator=g)]
    batch = {k: [] for k in ("old", "new", "adv", "mask", "values", "returns", "vpreds")}
    for r in lengths:
        old = -2.5 * torch.rand(r, generator=g, dtype=torch.float64)
        batch["old"].append(old)
        batch["new"].append(old + 0.4 * torch.randn(r, generator=g, dtype=torch.float64))
        batch["adv"].append(
            torch.full((r,), 3 * float(torch.randn(1, generator=g))) + 0.3 * torch.randn(r, generator=g)
        )
        mask = torch.ones(r, dtype=torch.bool)
        mask[torch.rand(r, generator=g) < 0.15] = False
        mask[0] = True
        batch["mask"].append(mask)
        batch["values"].append(torch.randn(r, generator=g, dtype=torch.float64))
        batch["returns"].append(torch.randn(r, generator=g, dtype=torch.float64))
        batch["vpreds"].append(batch["values"][-1] + 0.6 * torch.randn(r, generator=g, dtype=torch.float64))
    return batch


# Two packings of 12 samples over 2 ranks ([rank][micro-batch] -> samples): halves in one micro-batch each; and
# 3 samples in micro-batches of one on rank 0, the other 9 reversed in micro-batches of 4, 4 and 1 on rank 1.
PACKINGS = (
    [[list(range(6))], [list(range(6, 12))]],
    [[[0], [1], [2]], [[11, 10, 9, 8], [7, 6, 5, 4], [3]]],
)


def _padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Right-padded to the micro-batch's longest, as `to_padded_tensor` pads verl's nested fields."""
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True)


def _direct_difference(batch: dict, leaf_key: str, micro_loss) -> float:
    """The largest difference between the two PACKINGS of the gradients of `micro_loss(micro-batch, dp, tokens,
    samples)` with respect to the samples' `leaf_key`, summed over all micro-batches, over the largest."""
    grads = []
    n = len(batch["mask"])
    tokens = int(sum(m.sum() for m in batch["mask"]))
    for seed, packing in enumerate(PACKINGS):
        torch.manual_seed(seed)
        leaves = [t.clone().requires_grad_(True) for t in batch[leaf_key]]
        for rank in packing:
            for micro in rank:
                fields = {k: _padded([v[i] for i in micro]) for k, v in batch.items() if k != leaf_key}
                fields[leaf_key] = _padded([leaves[i] for i in micro])
                micro_loss(fields, len(packing), tokens, n).backward()
        grads.append(torch.cat([t.grad for t in leaves]))
    return float((grads[0] - grads[1]).abs().max() / grads[0].abs().max())


def _direct_policy_difference(config, seed: int) -> float:
    loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)

    def micro_loss(f, dp, tokens, samples):
        config.global_batch_info.update(
            dp_size=dp, batch_num_tokens=tokens, global_batch_size=samples, loss_scale_factor=config.loss_scale_factor
        )
        loss, _ = loss_fn(
            old_log_prob=f["old"],
            log_prob=f["new"],
            advantages=f["adv"],
            response_mask=f["mask"],
            loss_agg_mode=config.loss_agg_mode,
            config=config,
        )
        return loss

    return _direct_difference(_direct_batch(seed), "new", micro_loss)


@pytest.mark.parametrize("loss_mode", list(POLICY_LOSS_REGISTRY))
def test_probe_agrees_with_a_direct_two_packing_computation(loss_mode):
    for agg, factor in AGGREGATIONS:
        verdict = loss_table.verdict("policy", loss_mode, agg, factor, SHAPE)
        direct = max(_direct_policy_difference(_actor_config(loss_mode, agg, factor), seed) for seed in range(2))
        name = f"{agg}" + (f", loss_scale_factor={factor}" if factor else "")
        assert verdict.failure is None and verdict.invariant == (direct <= DIRECT_RTOL), (loss_mode, name, verdict)
        if loss_mode in PACKING_DEPENDENT or (agg == "seq-mean-token-sum-norm" and not factor and loss_mode != "sapo"):
            assert not verdict.invariant, (loss_mode, name)


@pytest.mark.parametrize("agg,factor", AGGREGATIONS)
def test_critic_probe_agrees_with_a_direct_two_packing_computation(agg, factor):
    from verl.trainer.ppo.core_algos import compute_value_loss
    from verl.workers.config import FSDPCriticConfig

    config = FSDPCriticConfig(
        strategy="fsdp2", ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg, loss_scale_factor=factor
    )
    verdict = loss_table.verdict("critic", "", agg, factor, SHAPE)

    def micro_loss(f, dp, tokens, samples):
        loss, _ = compute_value_loss(
            vpreds=f["vpreds"],
            returns=f["returns"],
            values=f["values"],
            response_mask=f["mask"],
            cliprange_value=config.cliprange_value,
            loss_agg_mode=agg,
            dp_size=dp,
            batch_num_tokens=tokens,
            global_batch_size=samples,
            loss_scale_factor=factor,
        )
        return loss

    direct = _direct_difference(_direct_batch(0), "vpreds", micro_loss)
    assert verdict.invariant == (direct <= DIRECT_RTOL) == (agg != "seq-mean-token-sum-norm" or bool(factor))


def test_entropy_and_kl_terms_are_probed_with_the_aggregation():
    """sapo aggregates its own term as seq-mean-token-mean whatever loss_agg_mode says; the entropy and KL
    terms do use loss_agg_mode, so an unscaled seq-mean-token-sum-norm refuses it only with them."""
    agg = {"loss_agg_mode": "seq-mean-token-sum-norm"}
    assert probe_actor_loss(_actor_config("sapo", **agg), SHAPE).invariant
    assert not probe_actor_loss(_actor_config("sapo", **agg, entropy_coeff=0.01), SHAPE).invariant
    assert not probe_actor_loss(_actor_config("sapo", **agg, use_kl_loss=True), SHAPE).invariant
    kl = {"use_kl_loss": True, "kl_loss_type": "k3+", "entropy_coeff": 0.01}
    assert probe_actor_loss(_actor_config("sapo", **kl), SHAPE, rollout_is_weights=True).invariant


def test_probe_leaves_the_callers_random_state_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    probe_actor_loss(_actor_config("clip_cov"), SHAPE)  # draws a permutation per micro-batch
    assert torch.equal(torch.rand(3), expected)


def test_the_loss_table_in_the_docs_is_what_the_probe_finds():
    """docs/verl.md's table of every registered loss's verdict, as tests/verl/loss_table.py computes it now."""
    assert loss_table.documented() == loss_table.table(), (
        "docs/verl.md's loss table is not what the probe finds; if the change is meant: python -m tests.verl.loss_table"
    )


# ---------------------------------------------------------------------------------------------
# the probe's data and packings
# ---------------------------------------------------------------------------------------------


def test_packings_are_verls_and_odcs():
    """fsdp2's packing: equal shares cut as verl cuts them (the same number of micro-batches on every rank
    under a budget); odc's: LB-Mini's uneven shares, or verl's equal ones under lb_micro, each cut as the odc
    engine cuts a share; every sample once in each; micro-batches of one sample stay one sample."""
    lengths = [int(x) for x in torch.randint(2, 150, (32,), generator=torch.Generator().manual_seed(0))]
    fixed = dataclasses.replace(SHAPE, micro_batch_size=2, max_token_len=None)
    one = dataclasses.replace(fixed, micro_batch_size=1)
    for shape in (SHAPE, fixed, one, dataclasses.replace(SHAPE, balancer="lb_micro")):
        fsdp2, odc = packings(shape, lengths, seed=1)
        for packing in (fsdp2, odc):
            assert sorted(s for rank in packing for micro in rank for s in micro) == list(range(32)), shape
            if shape.micro_batch_size is None:
                assert all(sum(lengths[s] for s in micro) <= SHAPE.max_token_len for rank in packing for micro in rank)
            else:
                assert all(len(micro) <= shape.micro_batch_size for rank in packing for micro in rank)
        assert {len(rank) for rank in fsdp2} == {len(fsdp2[0])}  # fsdp2: the same count on every rank
        shares = [sum(len(micro) for micro in rank) for rank in odc]
        if shape.balancer == "lb_micro":
            assert [sorted(s for micro in rank for s in micro) for rank in odc] == [
                sorted(s for micro in rank for s in micro) for rank in fsdp2
            ]
            assert len({len(rank) for rank in odc}) > 1  # each rank its own count: what the probe compares
        else:
            assert len(set(shares)) > 1  # LB-Mini's uneven shares
    fsdp2, odc = packings(one, lengths, seed=1)
    assert all(len(micro) == 1 for packing in (fsdp2, odc) for rank in packing for micro in rank)


def test_advantages_per_token_follow_the_estimator():
    """GAE's advantages differ over a response's tokens, GRPO's and RLOO's do not; an estimator that cannot run
    on the probe's batch counts as per token."""
    from omegaconf import OmegaConf

    base = compose([]).algorithm
    for estimator, per_token in (("gae", True), ("grpo", False), ("rloo", False), ("reinforce_plus_plus", False)):
        algorithm = OmegaConf.merge(base, {"adv_estimator": estimator})
        assert advantages_per_token(algorithm, group_size=4) is per_token, estimator
    assert advantages_per_token(OmegaConf.merge(base, {"adv_estimator": "no_such_estimator"}), group_size=4)


def test_micro_batches_of_one_sample_train_packing_dependent_losses_as_fsdp2():
    """With a fixed micro-batch size of 1, odc runs each sample in a micro-batch of its own, as fsdp2 does: GMPO
    and KL-Cov are the same whatever rank runs a sample; Clip-Cov too with GRPO's advantages (one per response:
    a single response's covariance is 0, so it clips nothing), not with GAE's, where it draws among a response's
    tokens at random and the draws follow the rank's random stream. Under LB-Mini's dynamic packing all three
    are refused in every aggregation."""
    for mode in PACKING_DEPENDENT:
        assert not any(loss_table.verdict("policy", mode, agg, None, SHAPE).invariant for agg in LOSS_AGG_MODES)
        assert loss_table.verdict("policy", mode, "token-mean", None, loss_table.ONE_PER_RESPONSE).invariant, mode
        per_token = loss_table.verdict("policy", mode, "token-mean", None, loss_table.ONE_PER_TOKEN)
        assert per_token.invariant == (mode != "clip_cov"), mode


# ---------------------------------------------------------------------------------------------
# the refusal, through the entry the trainer calls
# ---------------------------------------------------------------------------------------------

BASE = [
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=8",
    "data.max_prompt_length=96",
    "data.max_response_length=64",
    "actor_rollout_ref.rollout.n=4",
    f"{ACTOR}.ppo_mini_batch_size=8",
    f"{ACTOR}.use_dynamic_bsz=True",
    f"{ACTOR}.ppo_max_token_len_per_gpu=160",
    f"{ACTOR}.strategy=odc",
]
CRITIC = [
    "algorithm.adv_estimator=gae",
    "critic.strategy=odc",
    "critic.ppo_mini_batch_size=8",
    "critic.ppo_micro_batch_size_per_gpu=2",
]
ODC_OPTIONS = ["hydra.searchpath=[pkg://odc_plugin.configs]", "model_engine=odc"]
# a fixed micro-batch size of 1 (verl requires the log-prob passes to batch as the update does)
ONE_SAMPLE = [
    f"{ACTOR}.use_dynamic_bsz=False",
    f"{ACTOR}.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
]
AS_FSDP2 = (
    f"pack as fsdp2 with {ACTOR}.fsdp_config.odc_balancer=lb_micro and a fixed micro-batch size, or train {ACTOR} "
    f"with strategy=fsdp2"
)


def _refusal(*overrides) -> str:
    with pytest.raises(ValueError) as refused:
        check_losses(compose([*BASE, *overrides]))
    message = str(refused.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("loss_mode", PACKING_DEPENDENT)
def test_packing_dependent_policy_losses_are_refused_in_one_line(loss_mode):
    """The refusal names the key, and what would train as fsdp2: the registry's invariant modes, micro-batches of
    one sample where they are invariant (not Clip-Cov's with GAE's advantages, BASE's estimator), fsdp2's
    packing, fsdp2."""
    message = _refusal(f"{ACTOR}.policy_loss.loss_mode={loss_mode}")
    assert message.startswith(
        f"odc: {ACTOR}.policy_loss.loss_mode={loss_mode} depends on which samples share a micro-batch or a rank "
        f"(packed as odc packs them, the same mini-batch's gradient differs by "
    )
    offered = message.split("use a packing-invariant policy_loss.loss_mode (")[1].split(")")[0].split(", ")
    assert {"vanilla", "gspo", "cispo"} <= set(offered) and not set(offered) & set(PACKING_DEPENDENT)
    one_sample = f"use micro-batches of one sample ({ACTOR}.ppo_micro_batch_size_per_gpu=1 with use_dynamic_bsz=False"
    assert (one_sample in message) == (loss_mode != "clip_cov")
    assert message.endswith(AS_FSDP2)


def test_micro_batches_of_one_sample_pass_packing_dependent_losses():
    """With a fixed micro-batch size of 1 under LB-Mini and GRPO's advantages: accepted; Clip-Cov with GAE's is
    refused, and offered the modes that are invariant in micro-batches of one sample (GMPO, KL-Cov among them)."""
    grpo = "algorithm.adv_estimator=grpo"
    for mode in PACKING_DEPENDENT:
        (verdict,) = check_losses(compose([*BASE, *ONE_SAMPLE, grpo, f"{ACTOR}.policy_loss.loss_mode={mode}"])).values()
        assert verdict.invariant, mode
    message = _refusal(*ONE_SAMPLE, f"{ACTOR}.policy_loss.loss_mode=clip_cov")
    offered = message.split("use a packing-invariant policy_loss.loss_mode (")[1].split(")")[0].split(", ")
    assert {"geo_mean", "kl_cov", "vanilla"} <= set(offered) and "micro-batches of one sample" not in message


def test_geo_mean_with_unscaled_seq_mean_token_sum_norm_is_told_to_set_the_factor_too():
    """GMPO ignores the aggregation, the entropy and KL terms do not: another loss mode alone would still be
    refused for the unscaled seq-mean-token-sum-norm, so the refusal names loss_scale_factor with it."""
    message = _refusal(f"{ACTOR}.policy_loss.loss_mode=geo_mean", f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm")
    assert (
        f"; set {ACTOR}.loss_scale_factor (e.g. to data.max_response_length) and use a packing-invariant "
        f"policy_loss.loss_mode (vanilla, " in message
    )


def test_unscaled_seq_mean_token_sum_norm_is_refused_for_actor_and_critic():
    for role, extra in ((ACTOR, []), ("critic", CRITIC)):
        assert _refusal(*extra, f"{role}.loss_agg_mode=seq-mean-token-sum-norm") == (
            f"odc: {role}.loss_agg_mode=seq-mean-token-sum-norm without {role}.loss_scale_factor divides each "
            f"micro-batch's loss by its own padded length, which differs under strategy=odc; set "
            f"{role}.loss_scale_factor (e.g. to data.max_response_length)"
        )
    scaled = [
        "critic.loss_agg_mode=seq-mean-token-sum-norm",
        "critic.loss_scale_factor=64",
        "critic.cliprange_value=0.1",
    ]
    verdicts = check_losses(compose([*BASE, *CRITIC, *scaled]))
    assert set(verdicts) == {ACTOR, "critic"} and all(v.invariant for v in verdicts.values())


def test_roles_on_fsdp2_are_not_probed_and_fsdp2_packing_is_not_refused():
    assert check_losses(compose([*BASE[:-1], f"{ACTOR}.policy_loss.loss_mode=geo_mean"])) == {}
    fixed = [f"{ACTOR}.use_dynamic_bsz=False", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2"]
    # odc's engine config for every role (the critic's too: it needs its micro-batch size then)
    lb_micro = [*ODC_OPTIONS, f"{ACTOR}.fsdp_config.odc_balancer=lb_micro", "critic.ppo_micro_batch_size_per_gpu=2"]
    geo_mean = f"{ACTOR}.policy_loss.loss_mode=geo_mean"
    assert ACTOR not in check_losses(compose([*BASE, *lb_micro, *fixed, geo_mean]))  # packs as fsdp2: not probed
    _refusal(*lb_micro, geo_mean)  # dynamic batch sizes: each rank packs its own number of micro-batches
    _refusal(*fixed, geo_mean)  # LB-Mini's uneven shares


def test_critic_packing_is_its_engines():
    """verl 0.9.1 builds the critic's engine from critic.fsdp alone (use_dynamic_bsz True by default there, with
    the critic's inference token budget): critic.use_dynamic_bsz=False with a micro-batch size does not make
    it pack as fsdp2 under lb_micro, whose ranks each pack their own number of micro-batches; a packing-dependent
    critic loss is refused where those numbers can differ, accepted where the budget holds a rank's whole share
    (here by default: 16 samples of at most 160 tokens, 32768 tokens); lockstep packs as fsdp2."""
    sum_norm = [
        *CRITIC,
        *ODC_OPTIONS,
        "critic.fsdp.odc_balancer=lb_micro",
        "critic.use_dynamic_bsz=False",
        "critic.loss_agg_mode=seq-mean-token-sum-norm",
    ]
    tight = "+critic.ppo_infer_max_token_len_per_gpu=320"
    assert _refusal(*sum_norm, tight).startswith("odc: critic.loss_agg_mode=seq-mean-token-sum-norm without ")
    assert check_losses(compose([*BASE, *sum_norm]))["critic"].invariant
    verdicts = check_losses(compose([*BASE, *sum_norm, tight, "critic.fsdp.odc_lockstep=True"]))
    assert list(verdicts) == [ACTOR]  # the critic packs as under fsdp2: not probed


@needs_tq
@pytest.mark.parametrize("loss_mode", PACKING_DEPENDENT)
def test_trainer_init_refuses_before_anything_starts(loss_mode):
    """The trainer class an odc run gets (odc_plugin.verl.trainer), built on the run's configuration; its
    __init__ would start Ray and TransferQueue, its init builds the workers unless the loss is refused."""
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    from odc_plugin.verl.trainer import trainer_class

    config = compose([*BASE, f"{ACTOR}.policy_loss.loss_mode={loss_mode}"])
    trainer = object.__new__(trainer_class(get_trainer_cls("sync"), config))
    trainer.config = config
    with pytest.raises(ValueError, match=rf"^odc: {ACTOR}\.policy_loss\.loss_mode={loss_mode} depends on"):
        trainer.init()
    assert not hasattr(trainer, "tokenizer")  # verl's init never ran


# ---------------------------------------------------------------------------------------------
# losses a user registers
# ---------------------------------------------------------------------------------------------

MICRO_MEAN, AGG_LOSS = "odc_test_micro_batch_mean", "odc_test_agg_loss"


def _micro_batch_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """REINFORCE averaged over the micro-batch's own tokens: verl's global batch info left unused."""
    import verl.utils.torch_functional as verl_F

    return verl_F.masked_mean(-advantages * log_prob, response_mask), {}


def _with_agg_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """The same REINFORCE term, aggregated by verl's agg_loss with the mini-batch's global batch info."""
    loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode, **config.global_batch_info)
    return loss, {}


def _micro_batch_mean_nan_above_0(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """_micro_batch_mean, NaN where a log-probability is above 0, which no real one is."""
    import verl.utils.torch_functional as verl_F

    return verl_F.masked_mean(torch.where(log_prob > 0, torch.nan, -advantages * log_prob), response_mask), {}


def _with_agg_loss_and_micro_batch_mean_where(where):
    """_with_agg_loss plus REINFORCE averaged over the micro-batch's tokens where `where(old_log_prob,
    advantages)`: packing-dependent where there are such tokens, invariant on a batch without any."""

    def loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        import verl.utils.torch_functional as verl_F

        invariant, _ = _with_agg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
        selected = response_mask & where(old_log_prob, advantages)
        return invariant + verl_F.masked_mean(-advantages * log_prob, selected), {}

    return loss


def _not_finite(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """_with_agg_loss of a log-probability's square root: NaN on every real one."""
    return _with_agg_loss(old_log_prob, log_prob.sqrt(), advantages, response_mask, loss_agg_mode, config)


def _needs_a_process_group(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """_with_agg_loss over the data-parallel world, read from torch.distributed: there is none in the trainer's
    process, where the probe runs."""
    loss, metrics = _with_agg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
    return loss / torch.distributed.get_world_size(), metrics


LOW_TAIL, LARGE_ADVANTAGES = "odc_test_low_tail", "odc_test_large_advantages"
NAN_ABOVE_0, NOT_FINITE, NEEDS_GROUP = "odc_test_nan_above_0", "odc_test_not_finite", "odc_test_needs_group"
USER_LOSSES = {
    MICRO_MEAN: _micro_batch_mean,
    AGG_LOSS: _with_agg_loss,
    NAN_ABOVE_0: _micro_batch_mean_nan_above_0,
    LOW_TAIL: _with_agg_loss_and_micro_batch_mean_where(lambda old, adv: old < -10),
    LARGE_ADVANTAGES: _with_agg_loss_and_micro_batch_mean_where(lambda old, adv: adv.abs() > 8),
    NOT_FINITE: _not_finite,
    NEEDS_GROUP: _needs_a_process_group,
}


def _register_user_losses() -> None:
    for name, loss in USER_LOSSES.items():
        register_policy_loss(name)(loss)


@pytest.fixture
def user_losses():
    _register_user_losses()
    yield
    for name in USER_LOSSES:
        POLICY_LOSS_REGISTRY.pop(name)


def test_user_registered_losses_refused_or_passed_by_what_they_normalize_by(user_losses):
    message = _refusal(f"{ACTOR}.policy_loss.loss_mode={MICRO_MEAN}")
    assert message.startswith(f"odc: {ACTOR}.policy_loss.loss_mode={MICRO_MEAN} depends on which samples share")
    assert AGG_LOSS in message  # offered: it is packing-invariant
    (verdict,) = check_losses(compose([*BASE, f"{ACTOR}.policy_loss.loss_mode={AGG_LOSS}"])).values()
    assert verdict.invariant


def test_the_probe_draws_data_like_real_rl_data(user_losses):
    """Log-probabilities at or below 0 (a loss that is NaN above 0 is compared, and refused for its micro-batch
    mean), with a tail below -10, and advantages of size 10: a loss whose dependence on the packing shows only
    there is refused."""
    for mode in (NAN_ABOVE_0, LOW_TAIL, LARGE_ADVANTAGES):
        assert _refusal(f"{ACTOR}.policy_loss.loss_mode={mode}").startswith(
            f"odc: {ACTOR}.policy_loss.loss_mode={mode} depends on which samples share a micro-batch or a rank "
        ), mode


def test_a_loss_that_raises_or_is_not_finite_is_refused_in_one_line_unless_packed_as_fsdp2(user_losses):
    def unchecked(mode: str) -> str:
        return (
            f"odc: cannot tell whether {ACTOR}'s loss (policy_loss.loss_mode={mode}, loss_agg_mode=token-mean) "
            f"trains under strategy=odc as under fsdp2: "
        )

    assert _refusal(f"{ACTOR}.policy_loss.loss_mode={NOT_FINITE}") == (
        f"{unchecked(NOT_FINITE)}its gradient is not finite on synthetic data drawn like a real batch ({DATA_RANGES}); "
        f"pack as fsdp2 with {ACTOR}.fsdp_config.odc_balancer=lb_micro and a fixed micro-batch size (it is not "
        f"probed then), or train {ACTOR} with strategy=fsdp2"
    )
    assert _refusal(f"{ACTOR}.policy_loss.loss_mode={NEEDS_GROUP}").startswith(
        f"{unchecked(NEEDS_GROUP)}it raised ValueError: Default process group has not been initialized"
    )
    # packed as fsdp2 packs it, a loss is not probed: it trains as under fsdp2, whatever it needs
    lb_micro = [*ODC_OPTIONS, f"{ACTOR}.fsdp_config.odc_balancer=lb_micro", "critic.ppo_micro_batch_size_per_gpu=2"]
    for mode in (NOT_FINITE, NEEDS_GROUP):
        config = compose([*BASE, *lb_micro, *ONE_SAMPLE, f"{ACTOR}.policy_loss.loss_mode={mode}"])
        assert ACTOR not in check_losses(config)


DISTILL_MICRO_MEAN = "odc_test_distillation_over_micro_batch"


@pytest.fixture
def user_distillation_loss():
    from verl.trainer.distillation.losses import (
        DISTILLATION_LOSS_REGISTRY,
        DISTILLATION_SETTINGS_REGISTRY,
        DistillationLossSettings,
        register_distillation_loss,
    )

    def over_micro_batch(config, distillation_config, model_output, data):
        """k3 against the teacher over its mean in the micro-batch, a constant (not differentiated, or every
        micro-batch's aggregate would be a constant too): normalized by the micro-batch."""
        import verl.utils.torch_functional as verl_F
        from verl.trainer.ppo.core_algos import kl_penalty
        from verl.workers.utils.padding import no_padding_2_padding

        student = no_padding_2_padding(model_output["log_probs"], data)
        teacher = no_padding_2_padding(data["teacher_logprobs"], data).squeeze(-1)
        losses = kl_penalty(student, teacher, "k3")
        scale = verl_F.masked_mean(losses, data["response_mask"].to_padded_tensor(0).bool()).detach()
        return losses / scale, {}

    register_distillation_loss(DistillationLossSettings(names=DISTILL_MICRO_MEAN, use_estimator=True))(over_micro_batch)
    yield
    DISTILLATION_LOSS_REGISTRY.pop(DISTILL_MICRO_MEAN)
    DISTILLATION_SETTINGS_REGISTRY.pop(DISTILL_MICRO_MEAN)


def test_distillation_losses_are_probed(user_distillation_loss):
    """On-policy distillation's loss is the actor's: verl's pass; one a user registers that normalizes by its
    micro-batch is refused, naming the distillation loss and offering verl's that pass."""
    distillation = ["distillation.enabled=True", "distillation.distillation_loss.loss_mode"]
    (verdict,) = check_losses(compose([*BASE, f"{distillation[0]}", f"{distillation[1]}=k3"])).values()
    assert verdict.invariant
    message = _refusal(distillation[0], f"{distillation[1]}={DISTILL_MICRO_MEAN}")
    assert message.startswith(f"odc: {distillation[1]}={DISTILL_MICRO_MEAN} depends on which samples share ")
    offered = message.split(f"use a packing-invariant {distillation[1]} (")[1].split(")")[0].split(", ")
    assert {"k3", "low_var_kl", "forward_kl_topk"} <= set(offered) and "k1" not in offered  # k1: a reward only


# 8 samples in one optimizer step, micro-batches of 2: verl's equal shares [0-3], [4-7]; uneven ones.
USER_BATCH, USER_SEED = 8, 3
UNEVEN = [[0, 1, 2], [3, 4, 5, 6, 7]]


def user_losses_on_ranks(rank, world_size, model_dir):
    """Rank body: one optimizer step with each user loss in turn (AGG_LOSS, then MICRO_MEAN), under fsdp2 on
    verl's equal shares and under odc's engine on UNEVEN shares, from the same weights; the weights before and
    after each step."""
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    _register_user_losses()  # a rank is a process of its own
    states = {}
    for strategy in ("odc", "fsdp2"):
        worker = H.build_engine("language_model", strategy, model_dir, use_dynamic_bsz=False, **SGD)
        states[strategy, "start"] = H.full_state_dict(worker)
        share = {"indices": UNEVEN[rank]} if strategy == "odc" else {"world_size": world_size, "rank": rank}
        batch = H.make_grpo_batch(USER_SEED, USER_BATCH, micro_batch_size_per_gpu=2, **share)
        for mode in (AGG_LOSS, MICRO_MEAN):
            role = dataclasses.replace(worker.role_config, policy_loss=PolicyLossConfig(loss_mode=mode))
            worker.set_loss_fn(partial(ppo_loss, config=role))
            H.train_step(worker, batch)
            states[strategy, mode] = H.full_state_dict(worker)
        del worker
    return states


def test_user_losses_train_under_odc_as_under_fsdp2_only_when_packing_invariant(tmp_path):
    model_dir = H.make_tiny_qwen2(str(tmp_path))
    states = H.run_on_ranks(user_losses_on_ranks, 2, model_dir, plugin_modules=["odc_plugin.verl.plugin"])[0]

    def step_difference(before: str, after: str) -> float:
        """How far odc's update of the step differs from fsdp2's, over fsdp2's largest."""
        delta = {s: {k: states[s, after][k] - states[s, before][k] for k in states[s, after]} for s in ("odc", "fsdp2")}
        largest = max(float(d.abs().max()) for d in delta["fsdp2"].values())
        return max(float((delta["odc"][k] - delta["fsdp2"][k]).abs().max()) for k in delta["odc"]) / largest

    assert all(torch.equal(states["odc", "start"][k], states["fsdp2", "start"][k]) for k in states["odc", "start"])
    # the agg_loss step trains the same weights; from them, the micro-batch mean's step does not
    same, other = step_difference("start", AGG_LOSS), step_difference(AGG_LOSS, MICRO_MEAN)
    print(f"\nodc against fsdp2, one step: {AGG_LOSS} {same:.1e}, {MICRO_MEAN} {other:.1e}")
    assert same < 1e-5 and other > 1e-2
