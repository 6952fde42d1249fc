"""The loss probe (odc_plugin/verl/loss_probe.py) and the refusal it decides (odc_plugin.verl.dispatch.check_losses,
called by the patched `PPOTrainer.init`).

* every policy loss in verl 0.9.1's registry under every `loss_agg_mode` verl accepts (and
  `seq-mean-token-sum-norm` with a `loss_scale_factor`): the probe's verdict is what a direct computation
  written here finds, calling the registered function itself on padded micro-batches of two packings of its
  own; the losses known to depend on the packing (GMPO, Clip-Cov, KL-Cov) are found to, in every mode;
* the critic's value loss under every `loss_agg_mode`, the same way;
* the trainer's entry refuses geo_mean, clip_cov and kl_cov (and the critic's unscaled
  `seq-mean-token-sum-norm`) at start, in one line naming the key, before anything else starts; a role that
  packs as fsdp2 does (`odc_balancer=lb_micro`, fixed micro-batch sizes) is not refused;
* losses a user registers with `register_policy_loss`: one normalizing by its own micro-batch is refused, one
  using verl's `agg_loss` passes, and verl's real engines on 2 gloo ranks show why: under odc's uneven shares
  the first trains other weights than under fsdp2, the second the same;
* the probe leaves the caller's random state alone.

The table of every registered mode's verdict and difference is printed with `-s`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from functools import partial

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, get_policy_loss_fn, register_policy_loss

from odc_plugin.verl.dispatch import ACTOR, check_losses
from odc_plugin.verl.loss_probe import LOSS_AGG_MODES, ProbeShape, probe_actor_loss, probe_critic_loss
from odc_plugin.verl.ppo_config import compose
from tests.verl import harness as H
from tests.verl.dispatch_ranks import SGD

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None
needs_tq = pytest.mark.skipif(
    not HAS_TQ,
    reason="verl's v1 trainer imports the TransferQueue package (pip install TransferQueue==0.1.10)",
)

# The run's shape the tests probe: odc-grpo-cpu's (2 ranks, 8 prompts x 4 responses, dynamic batch sizes).
SHAPE = ProbeShape(dp_size=2, samples=32, max_prompt_length=96, max_response_length=64, max_token_len=160)
# The aggregations a mode is tested under: verl's, and seq-mean-token-sum-norm with a loss_scale_factor.
AGGREGATIONS = [(mode, None) for mode in LOSS_AGG_MODES] + [("seq-mean-token-sum-norm", 64)]
# Losses whose gradient depends on the micro-batch's own samples, whatever the aggregation.
PACKING_DEPENDENT = ("geo_mean", "clip_cov", "kl_cov")
DIRECT_RTOL = 1e-9  # float64, as the probe's


def _actor_config(loss_mode: str, loss_agg_mode: str = "token-mean", loss_scale_factor=None, **kw):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=4,
        use_dynamic_bsz=True,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        # dro refuses to run without its penalty
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.1),
        **kw,
    )


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


@pytest.fixture(scope="module")
def registry_table():
    rows: list[str] = []
    yield rows
    print("\n| policy_loss.loss_mode | loss_agg_mode | probe | difference (probe; direct) |\n|---|---|---|---|")
    print("\n".join(rows))


@pytest.mark.parametrize("loss_mode", list(POLICY_LOSS_REGISTRY))
def test_probe_agrees_with_a_direct_two_packing_computation(loss_mode, registry_table):
    for agg, factor in AGGREGATIONS:
        config = _actor_config(loss_mode, agg, factor)
        verdict = probe_actor_loss(config, SHAPE)
        direct = max(_direct_policy_difference(config, seed) for seed in range(2))
        name = f"{agg}" + (f", loss_scale_factor={factor}" if factor else "")
        assert verdict.invariant == (direct <= DIRECT_RTOL), (loss_mode, name, verdict, direct)
        if loss_mode in PACKING_DEPENDENT or (agg == "seq-mean-token-sum-norm" and not factor and loss_mode != "sapo"):
            assert not verdict.invariant, (loss_mode, name)
        registry_table.append(
            f"| {loss_mode} | {name} | {'same' if verdict.invariant else 'refused'} | "
            f"{verdict.difference:.1e}; {direct:.1e} |"
        )


@pytest.mark.parametrize("agg,factor", AGGREGATIONS)
def test_critic_probe_agrees_with_a_direct_two_packing_computation(agg, factor):
    from verl.trainer.ppo.core_algos import compute_value_loss
    from verl.workers.config import FSDPCriticConfig

    config = FSDPCriticConfig(
        strategy="fsdp2", ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg, loss_scale_factor=factor
    )
    verdict = probe_critic_loss(config, SHAPE)

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


def _refusal(*overrides) -> str:
    with pytest.raises(ValueError) as refused:
        check_losses(compose([*BASE, *overrides]))
    message = str(refused.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("loss_mode", PACKING_DEPENDENT)
def test_packing_dependent_policy_losses_are_refused_in_one_line(loss_mode):
    message = _refusal(f"{ACTOR}.policy_loss.loss_mode={loss_mode}")
    assert message.startswith(
        f"odc: {ACTOR}.policy_loss.loss_mode={loss_mode} depends on which samples share a micro-batch (packed "
        f"otherwise, the same mini-batch's gradient differs by "
    )
    # what to do: the invariant modes of the registry, fsdp2's packing, or fsdp2
    offered = message.split("use a packing-invariant policy_loss.loss_mode (")[1].split(")")[0].split(", ")
    assert {"vanilla", "gspo", "cispo"} <= set(offered) and not set(offered) & set(PACKING_DEPENDENT)
    assert message.endswith(
        f"pack as fsdp2 with odc_balancer=lb_micro and a fixed micro-batch size, or train {ACTOR} with strategy=fsdp2"
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
    verdicts = check_losses(compose([*BASE, *lb_micro, *fixed, geo_mean]))
    assert not verdicts[ACTOR].invariant  # packing-dependent, but packed as under fsdp2
    _refusal(*lb_micro, geo_mean)  # dynamic batch sizes: each rank packs its own number of micro-batches
    _refusal(*fixed, geo_mean)  # LB-Mini's uneven shares


def test_critic_packing_is_its_engines():
    """verl 0.9.1 builds the critic's engine from critic.fsdp alone (use_dynamic_bsz True by default there, with
    the critic's inference token budget): critic.use_dynamic_bsz=False with a micro-batch size does not make
    it pack as fsdp2 under lb_micro, so a packing-dependent critic loss is refused; lockstep packs as fsdp2."""
    sum_norm = [
        *CRITIC,
        *ODC_OPTIONS,
        "critic.fsdp.odc_balancer=lb_micro",
        "critic.use_dynamic_bsz=False",
        "critic.loss_agg_mode=seq-mean-token-sum-norm",
    ]
    assert _refusal(*sum_norm).startswith("odc: critic.loss_agg_mode=seq-mean-token-sum-norm without ")
    verdicts = check_losses(compose([*BASE, *sum_norm, "critic.fsdp.odc_lockstep=True"]))
    assert not verdicts["critic"].invariant  # packing-dependent, but packed as under fsdp2


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


def _register_user_losses() -> None:
    register_policy_loss(MICRO_MEAN)(_micro_batch_mean)
    register_policy_loss(AGG_LOSS)(_with_agg_loss)


@pytest.fixture
def user_losses():
    _register_user_losses()
    yield
    for name in (MICRO_MEAN, AGG_LOSS):
        POLICY_LOSS_REGISTRY.pop(name)


def test_user_registered_losses_refused_or_passed_by_what_they_normalize_by(user_losses):
    message = _refusal(f"{ACTOR}.policy_loss.loss_mode={MICRO_MEAN}")
    assert message.startswith(f"odc: {ACTOR}.policy_loss.loss_mode={MICRO_MEAN} depends on which samples share")
    assert AGG_LOSS in message  # offered: it is packing-invariant
    (verdict,) = check_losses(compose([*BASE, f"{ACTOR}.policy_loss.loss_mode={AGG_LOSS}"])).values()
    assert verdict.invariant


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
