"""The trainer choice (patches/trainer_choice.py), the one patch applied in every process: verl's trainer class,
or its odc subclass when the run's configuration names odc; verl's legacy trainer and others' trainers refused
for odc in one line; another verl version fails odc runs only."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from odc_patches import PatchError

from .requires import needs_transfer_queue


def _config(*overrides):
    from odc_plugin.verl import ppo_config

    return ppo_config.compose(list(overrides))


@pytest.fixture(scope="module")
def configs():
    """Configurations as main_ppo composes them: verl's default (fsdp), fsdp2, odc on the actor, odc on
    the critic of a run that trains one, odc on a critic that a GRPO run does not build."""
    return {
        "fsdp": _config(),
        "fsdp2": _config("actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2"),
        "odc": _config("actor_rollout_ref.actor.strategy=odc", "critic.strategy=odc"),
        "odc critic": _config("algorithm.adv_estimator=gae", "critic.strategy=odc"),
        "odc critic, none built": _config("algorithm.adv_estimator=grpo", "critic.strategy=odc"),
    }


@dataclasses.dataclass
class _Actor:
    strategy: str = "fsdp2"


@dataclasses.dataclass
class _Roles:
    actor: _Actor = dataclasses.field(default_factory=_Actor)


@dataclasses.dataclass
class _DataclassConfig:
    """A configuration a user's own script might build: a dataclass, not OmegaConf."""

    actor_rollout_ref: _Roles = dataclasses.field(default_factory=_Roles)


@needs_transfer_queue
def test_trainer_choice_gives_verls_own_class_without_odc(configs):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    from odc_plugin.verl.trainer import trainer_class

    for trainer in (PPOTrainer, RayPPOTrainer):  # the plugin's choice, on the v1 trainers and the legacy one
        assert vars(trainer)["__new__"].__func__.__module__ == "odc_patches.trainer_choice"
    for cls in (*(get_trainer_cls(m) for m in ("sync", "colocate_async", "separate_async")), RayPPOTrainer):
        for name in ("fsdp", "fsdp2", "odc critic, none built"):
            assert trainer_class(cls, configs[name]) is cls, (cls, name)
    # what main_ppo's TaskRunner does, up to verl's own __init__ (which would start Ray)
    trainer = PPOTrainer.__new__(get_trainer_cls("sync"), config=configs["fsdp2"])
    assert type(trainer) is get_trainer_cls("sync") and not vars(trainer)
    trainer = RayPPOTrainer.__new__(RayPPOTrainer, config=configs["fsdp2"], tokenizer=None)
    assert type(trainer) is RayPPOTrainer and not vars(trainer)


@needs_transfer_queue
@pytest.mark.parametrize(
    "config",
    [
        {"actor_rollout_ref": {"actor": {"strategy": "fsdp2"}}, "critic": {"strategy": "fsdp2"}},
        {},
        _DataclassConfig(),
        None,
        "not a configuration at all",
    ],
    ids=["dict", "empty dict", "dataclass", "None", "str"],
)
def test_trainer_choice_gives_verls_class_for_any_configuration_without_odc(config):
    """A trainer built by a user's own code with a configuration that is not OmegaConf: verl's class, no exception,
    as keyword and as first positional argument, and with no argument at all."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    for base, cls in ((PPOTrainer, get_trainer_cls("sync")), (RayPPOTrainer, RayPPOTrainer)):
        assert type(base.__new__(cls, config=config)) is cls
        assert type(base.__new__(cls, config)) is cls
        assert type(base.__new__(cls)) is cls


@needs_transfer_queue
def test_trainer_choice_reads_odc_from_a_dict_configuration():
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    sync = get_trainer_cls("sync")
    trainer = PPOTrainer.__new__(sync, config={"actor_rollout_ref": {"actor": {"strategy": "odc"}}})
    assert type(trainer).__mro__[2] is sync and type(trainer)._odc_trainer


def test_trainer_choice_leaves_a_class_alone_whose_bases_define_new(caplog):
    """A verl whose trainer class, or any base of it, defines __new__: the choice is not given (it would hide that
    __new__, or be hidden by it), with one warning line; verl's __new__ stays in place."""
    from odc_patches import trainer_choice

    class Base:
        def __new__(cls, *args, **kwargs):
            return super().__new__(cls)

    class Trainer(Base):
        pass

    class Plain:
        pass

    verls = vars(Base)["__new__"]
    with caplog.at_level(logging.WARNING, logger=trainer_choice.__name__):
        trainer_choice.give_choice(Trainer)
        trainer_choice.give_choice(Base)
        trainer_choice.give_choice(Plain)
        trainer_choice.give_choice(Plain)  # applied once: no warning the second time
    assert "__new__" not in vars(Trainer) and vars(Base)["__new__"] is verls
    assert vars(Plain)["__new__"].__func__ is trainer_choice._new
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "odc patch 'trainer_choice' not applied: verl's test_trainer_choice_leaves_a_class_alone_whose_bases_define_"
        "new.<locals>.Trainer has a __new__ of its own now (defined by test_trainer_choice_leaves_a_class_alone_whose_"
        "bases_define_new.<locals>.Base); strategy=odc needs verl 0.9.1",
        "odc patch 'trainer_choice' not applied: verl's test_trainer_choice_leaves_a_class_alone_whose_bases_define_"
        "new.<locals>.Base has a __new__ of its own now (defined by test_trainer_choice_leaves_a_class_alone_whose_"
        "bases_define_new.<locals>.Base); strategy=odc needs verl 0.9.1",
    ]


@needs_transfer_queue
def test_trainer_choice_gives_the_odc_subclass_for_odc(configs):
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    from odc_plugin.verl.trainer import trainer_class

    for mode in ("sync", "colocate_async", "separate_async"):
        for name in ("odc", "odc critic"):
            cls = trainer_class(get_trainer_cls(mode), configs[name])
            assert cls.__mro__[2] is get_trainer_cls(mode) and cls is trainer_class(cls, configs[name])
        assert type(PPOTrainer.__new__(get_trainer_cls(mode), config=configs["odc"])) is cls


@needs_transfer_queue
def test_trainer_choice_refuses_others_trainers_in_one_line(configs):
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    class MyTrainer(get_trainer_cls("sync")):
        pass

    with pytest.raises(ValueError) as refused:
        PPOTrainer.__new__(MyTrainer, config=configs["odc"])
    assert str(refused.value) == (
        f"odc: the trainer {__name__}.test_trainer_choice_refuses_others_trainers_in_one_line.<locals>.MyTrainer is "
        f"not supported with strategy=odc, which plans verl's own trainers of trainer.v1.trainer_mode=sync, "
        f"colocate_async, separate_async only"
    )


@needs_transfer_queue
def test_trainer_choice_refuses_the_legacy_trainer_in_one_line(configs):
    """trainer.use_v1=False: main_ppo_v0 builds RayPPOTrainer(config=config, ...), which the choice refuses for odc
    (before any worker starts) and leaves to verl for other strategies."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    for name in ("odc", "odc critic"):
        with pytest.raises(ValueError) as refused:
            RayPPOTrainer.__new__(RayPPOTrainer, config=configs[name], tokenizer=None)
        assert str(refused.value) == (
            "odc: trainer.use_v1=False (verl's legacy trainer, main_ppo_v0) is not supported with strategy=odc: it "
            "dispatches every stage with verl's equal split and never runs odc's loss check or LB-Mini's plan; use "
            "trainer.use_v1=True (the default) or strategy=fsdp2"
        )
    assert type(RayPPOTrainer.__new__(RayPPOTrainer, config=configs["fsdp2"])) is RayPPOTrainer


@needs_transfer_queue
def test_the_legacy_trainer_is_refused_where_the_v1_trainer_cannot_be_imported(monkeypatch, configs):
    """The legacy trainer does not need TransferQueue, which verl's v1 trainers import: its refusal comes first."""
    import sys

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from odc_plugin.verl.trainer import LEGACY_REFUSAL

    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.v1", None)  # as if it failed to import
    with pytest.raises(ValueError, match="^" + re.escape(LEGACY_REFUSAL) + "$"):
        RayPPOTrainer.__new__(RayPPOTrainer, config=configs["odc"])


@needs_transfer_queue
def test_trainer_choice_on_another_verl_version_fails_odc_only(other_verl, configs):
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    assert type(PPOTrainer.__new__(get_trainer_cls("sync"), config=configs["fsdp2"])) is get_trainer_cls("sync")
    with pytest.raises(PatchError) as refused:
        PPOTrainer.__new__(get_trainer_cls("sync"), config=configs["odc"])
    assert str(refused.value) == (
        "strategy=odc needs verl 0.9.1, the version odc-verl's patches of verl were written for, but verl 0.9.2 "
        "is installed; install verl==0.9.1 for odc runs (runs of other strategies do not use the patches)"
    )
