"""The loss check an odc run makes at start: a loss whose update depends on how strategy=odc packs a
mini-batch is refused in one line, before any worker starts (`patches/lb_mini_dispatch.py` calls
`check_losses` from the trainer's `init`). The probing itself is `loss_probe.py`; how odc packs a role is
`dispatch.py`'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from odc_plugin.verl.dispatch import (
    ACTOR,
    TrainPacking,
    actor_packing,
    critic_packing,
    packs_as_fsdp2,
    sequence_parallel_size,
)
from odc_plugin.verl.loss_probe import (
    LOSS_AGG_MODES,
    TRIALS,
    ProbeShape,
    Verdict,
    advantages_per_token,
    probe_actor_loss,
    probe_critic_loss,
)


def check_losses(config) -> dict[str, Verdict]:
    """Refuse, before training, a loss whose update depends on how strategy=odc packs a mini-batch.

    verl's trainer config `config` names the losses: the actor's (`policy_loss.loss_mode` from verl's
    registry, `loss_agg_mode`, `loss_scale_factor`, the entropy and KL terms, on-policy distillation's loss)
    and the critic's (`loss_agg_mode`, `loss_scale_factor`, `cliprange_value`). A role that trains under
    strategy=odc and packs as fsdp2 does (`odc_balancer=lb_micro` with a fixed micro-batch size, or
    `odc_lockstep`) trains any loss the same and is not probed. For any other, `odc_plugin.verl.loss_probe`
    runs the role's loss on data like the run's, packed as fsdp2 packs it and as odc will; a role whose loss
    differs, raises or has no finite gradient there is refused with one line naming the settings that would
    make it train as under fsdp2. Returns each probed role's verdict, for the log.

    Long because it reads each role's shape from its own keys.
    """
    from omegaconf import OmegaConf
    from verl.trainer.distillation import is_distillation_enabled
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import DistillationConfig

    roles = config.actor_rollout_ref
    ranks = config.trainer.n_gpus_per_node * config.trainer.nnodes
    lengths = {
        "max_prompt_length": config.data.max_prompt_length,
        "max_response_length": config.data.max_response_length,
    }
    verdicts = {}
    if roles.actor.get("strategy") == "odc":
        actor = omega_conf_to_dataclass(roles.actor)
        packing = actor_packing(actor)
        if not packs_as_fsdp2(actor.engine, packing.use_dynamic_bsz):
            correction = config.algorithm.get("rollout_correction") or {}
            # what the trainer adds to the batch in decoupled rollout correction (trainer_base.py:1765-1793)
            weights = bool(
                correction.get("rollout_is") and not correction.get("bypass_mode") and roles.rollout.calculate_log_probs
            )
            # the loss reads the distillation config's distillation_loss alone; DistillationConfig's own
            # checks, of the teachers' resources, are verl's to make when it starts them
            distillation = (
                DistillationConfig(distillation_loss=omega_conf_to_dataclass(config.distillation.distillation_loss))
                if is_distillation_enabled(config.get("distillation"))
                else None
            )
            shape = _probe_shape(
                actor.engine,
                packing,
                ranks,
                actor.ppo_mini_batch_size * roles.rollout.n,
                per_token_advantages=advantages_per_token(config.algorithm, roles.rollout.n),
                **lengths,
            )
            verdicts[ACTOR] = _check_role(
                _ROLES[ACTOR],
                _Loss(actor, distillation),
                lambda loss, shape, trials=TRIALS: probe_actor_loss(
                    loss.config, shape, trials, rollout_is_weights=weights, distillation=loss.distillation
                ),
                shape,
            )
    if need_critic(config) and config.critic.get("strategy") == "odc":
        # without its model: instantiating the model's config loads its tokenizer, which no loss reads
        node = OmegaConf.to_container(config.critic, resolve=True)
        node.pop("model")
        critic = omega_conf_to_dataclass(node)
        packing = critic_packing(critic)
        if not packs_as_fsdp2(critic.engine, packing.use_dynamic_bsz):
            shape = _probe_shape(critic.engine, packing, ranks, critic.ppo_mini_batch_size * roles.rollout.n, **lengths)
            verdicts["critic"] = _check_role(
                _ROLES["critic"],
                _Loss(critic),
                lambda loss, shape, trials=TRIALS: probe_critic_loss(loss.config, shape, trials),
                shape,
            )
    return verdicts


def _probe_shape(engine_config, packing: TrainPacking, ranks: int, samples: int, **kw) -> ProbeShape:
    """A role's mini-batch as the probe takes it, packed as odc packs the role (`engine_config`'s balancer,
    `packing`'s micro-batches; verl packs a Ulysses group's micro-batch to its size times the per-GPU budget)."""
    from odc_plugin.verl.config import as_odc_config

    sp = sequence_parallel_size(engine_config)
    return ProbeShape(
        dp_size=ranks // sp,
        samples=samples,
        micro_batch_size=None if packing.use_dynamic_bsz else packing.micro_batch_size,
        max_token_len=packing.max_token_len * sp if packing.use_dynamic_bsz else None,
        balancer=as_odc_config(engine_config).odc_balancer,
        **kw,
    )


@dataclass(frozen=True)
class _Role:
    """A role's keys, as its refusal names them."""

    key: str  # its node in verl's trainer config
    engine: str  # the node of its odc options
    one_per_micro_batch: str  # the settings that give it micro-batches of one sample


_ROLES = {
    ACTOR: _Role(
        ACTOR,
        f"{ACTOR}.fsdp_config",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu=1 with use_dynamic_bsz=False, as under fsdp2",
    ),
    "critic": _Role(
        "critic",
        "critic.fsdp",
        "+critic.fsdp.micro_batch_size_per_gpu=1 with +critic.fsdp.use_dynamic_bsz=False, as under fsdp2",
    ),
}


@dataclass(frozen=True)
class _Loss:
    """What a role's loss is made of: the role's config (an ActorConfig or a CriticConfig) and, for an actor
    with on-policy distillation on, the DistillationConfig."""

    config: Any
    distillation: Any = None


@dataclass(frozen=True)
class _Knob:
    """A setting of a role's loss that a refusal may offer other values of."""

    key: str  # the full key
    label: str  # the key as the alternatives are offered
    value: str
    choices: tuple[str, ...]
    apply: Callable[[_Loss, str], _Loss]  # the loss with this setting at another value


def _knobs(role: _Role, loss: _Loss) -> list[_Knob]:
    """The settings of `loss` a refusal may name, most specific first: the policy loss, the distillation loss,
    the aggregation."""
    from verl.trainer.distillation.losses import DISTILLATION_LOSS_REGISTRY
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    replace = dataclasses.replace
    knobs = []
    policy = getattr(loss.config, "policy_loss", None)
    if policy is not None:
        knobs.append(
            _Knob(
                f"{role.key}.policy_loss.loss_mode",
                "policy_loss.loss_mode",
                policy.loss_mode,
                tuple(POLICY_LOSS_REGISTRY),
                lambda lo, mode: replace(lo, config=replace(lo.config, policy_loss=replace(policy, loss_mode=mode))),
            )
        )
    if loss.distillation is not None:
        distill = loss.distillation.distillation_loss
        knobs.append(
            _Knob(
                "distillation.distillation_loss.loss_mode",
                "distillation.distillation_loss.loss_mode",
                distill.loss_mode,
                tuple(DISTILLATION_LOSS_REGISTRY),
                lambda lo, mode: replace(
                    lo, distillation=replace(lo.distillation, distillation_loss=replace(distill, loss_mode=mode))
                ),
            )
        )
    knobs.append(
        _Knob(
            f"{role.key}.loss_agg_mode",
            "loss_agg_mode",
            loss.config.loss_agg_mode,
            LOSS_AGG_MODES,
            lambda lo, mode: replace(lo, config=replace(lo.config, loss_agg_mode=mode)),
        )
    )
    return knobs


def _check_role(role: _Role, loss: _Loss, probe: Callable, shape: ProbeShape) -> Verdict:
    """Probe the role's loss as odc packs the role; refuse it in one line when it could not be compared or its
    gradient depends on the packing, naming the settings that would make it train as under fsdp2: the first of
    its settings (`_knobs`) with values that would, micro-batches of one sample, fsdp2's packing, fsdp2."""
    verdict = probe(loss, shape)
    if verdict.invariant:
        return verdict
    knobs = _knobs(role, loss)
    as_fsdp2 = f"pack as fsdp2 with {role.engine}.odc_balancer=lb_micro and a fixed micro-batch size"
    if verdict.failure is not None:
        raise ValueError(
            f"odc: cannot tell whether {role.key}'s loss ({', '.join(f'{k.label}={k.value}' for k in knobs)}) trains "
            f"under strategy=odc as under fsdp2: {verdict.failure}; {as_fsdp2} (it is not probed then), or train "
            f"{role.key} with strategy=fsdp2"
        )
    config, scaled = loss.config, None
    if config.loss_agg_mode == "seq-mean-token-sum-norm" and config.loss_scale_factor is None:
        scaled = dataclasses.replace(
            loss, config=dataclasses.replace(config, loss_scale_factor=shape.max_response_length)
        )
        if _invariant(probe, scaled, shape):
            raise ValueError(
                f"odc: {role.key}.loss_agg_mode=seq-mean-token-sum-norm without {role.key}.loss_scale_factor divides "
                f"each micro-batch's loss by its own padded length, which differs under strategy=odc; set "
                f"{role.key}.loss_scale_factor (e.g. to data.max_response_length)"
            )
    fixes, (knob, others) = [], _first_alternatives(knobs, scaled or loss, probe, shape)
    if others:
        factor = f"set {role.key}.loss_scale_factor (e.g. to data.max_response_length) and " if scaled else ""
        fixes.append(f"{factor}use a packing-invariant {knob.label} ({', '.join(others)})")
    if shape.balancer == "lb_mini" and shape.micro_batch_size != 1:
        one = dataclasses.replace(shape, micro_batch_size=1, max_token_len=None)
        if _invariant(probe, loss, one):
            fixes.append(f"use micro-batches of one sample ({role.one_per_micro_batch})")
    raise ValueError(
        f"odc: {knob.key}={knob.value} depends on which samples share a micro-batch or a rank (packed as odc packs "
        f"them, the same mini-batch's gradient differs by {_percent(verdict.difference)} from fsdp2's), and "
        f"strategy=odc packs them otherwise than fsdp2; {', '.join([*fixes, as_fsdp2])}, or train {role.key} with "
        f"strategy=fsdp2"
    )


def _first_alternatives(knobs: list[_Knob], loss: _Loss, probe: Callable, shape: ProbeShape):
    """The first knob with values under which `loss` is packing-invariant, and those values (one trial each); the
    first knob and none if no knob has any. A value verl rejects (a distillation loss it forbids in this mode)
    is not one to offer."""
    for knob in knobs:
        others = []
        for choice in knob.choices:
            if choice == knob.value:
                continue
            try:
                candidate = knob.apply(loss, choice)
            except (ValueError, NotImplementedError):
                continue
            if _invariant(probe, candidate, shape):
                others.append(choice)
        if others:
            return knob, others
    return knobs[0], []


def _percent(fraction: float) -> str:
    """A fraction as a percentage to two figures, never rounded to 0%."""
    percent = 100 * fraction
    return f"{percent:.0f}%" if percent >= 10 else f"{percent:.2g}%"


def _invariant(probe: Callable, loss: _Loss, shape: ProbeShape) -> bool:
    """Whether `loss` is packing-invariant packed as `shape` says, in one trial: enough to choose what to offer."""
    return probe(loss, shape, trials=1).invariant
