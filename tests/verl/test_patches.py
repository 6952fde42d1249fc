"""Every patch in `patches/` builds on the installed verl 0.9.1 and refuses (PatchError) when what it
builds on is missing or changed. The patches for odc runs change nothing of verl's: they only extend the
subclasses odc runs use (odc_patches.odc_subclass), and another verl version fails them in one line; the
CPU patches replace verl's functions in place and, on another verl version, apply with a warning. Checks
run in-process on verl's own objects; `monkeypatch` puts back whatever a test changes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import logging
import re

import pytest
import torch
import verl
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, dispatch_lazy_compute_data_proto, register
from verl.utils.metric import Metric
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

import odc_patches
from odc_patches import PATCHES, PatchError, detach_actor, lb_mini_dispatch, lb_mini_worker, rank_metrics_agree

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None
needs_trainer = pytest.mark.skipif(
    not HAS_TQ,
    reason="verl's v1 trainer module imports transfer_queue, which is not installed "
    "(pip install TransferQueue==0.1.10)",
)


def _trainer():
    from verl.trainer.ppo.v1 import get_trainer_cls

    return get_trainer_cls("sync")


def _dispatch_mode(method):
    return getattr(method, MAGIC_ATTR)["dispatch_mode"]


def _verl_state() -> dict:
    """Every member of verl's classes that the patches for odc runs build on, and the content of the
    dispatch dicts registered on them."""
    classes = [ActorRolloutRefWorker, DetachActorWorker, TrainingWorker]
    if HAS_TQ:
        from verl.trainer.ppo.v1 import PPOTrainer, PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync

        classes += [PPOTrainer, PPOTrainerSync, PPOTrainerColocateAsync, PPOTrainerSeparateAsync]
    state = {}
    for cls in classes:
        for name, value in vars(cls).items():
            state[cls.__qualname__, name] = value
            mode = (getattr(value, MAGIC_ATTR, None) or {}).get("dispatch_mode")
            if isinstance(mode, dict):
                state[cls.__qualname__, name, "dispatch"] = dict(mode)
    return state


def _same(a: dict, b: dict) -> list:
    return [k for k in a.keys() | b.keys() if k not in a or k not in b or not (a[k] is b[k] or a[k] == b[k])]


def test_patch_list():
    assert PATCHES == ("lb_mini_worker", "lb_mini_dispatch", "rank_metrics_agree", "detach_actor")
    for name in PATCHES:
        patch = importlib.import_module(f"odc_patches.{name}")
        assert patch.VERL_VERSION == verl.__version__ == odc_patches.PATCHED_VERL_VERSION == "0.9.1"
        assert callable(patch.extend) and not hasattr(patch, "apply")  # they extend subclasses, never verl


def test_odc_subclasses_extend_verl_and_change_nothing_of_it():
    before = _verl_state()
    training = odc_patches.odc_subclass("training_worker", TrainingWorker, "T", __name__)
    actor = odc_patches.odc_subclass("actor_worker", ActorRolloutRefWorker, "A", __name__, actor_worker_cls=training)
    assert not _same(before, _verl_state())
    # the worker methods are verl's, registered again with the plan's dispatch in front of verl's
    for cls, method, mesh in (
        (actor, "update_actor", "actor"),
        (actor, "compute_log_prob", "actor"),
        (actor, "compute_ref_log_prob", "ref"),
        (training, "train_mini_batch", "train"),
        (training, "infer_batch", "train"),
    ):
        dispatch = _dispatch_mode(getattr(cls, method))["dispatch_fn"]
        assert dispatch.func is lb_mini_dispatch._lb_mini_dispatch and dispatch.args[0] == mesh
        assert dispatch.args[1].func is dispatch_lazy_compute_data_proto and dispatch.args[1].args == (mesh,)
        assert (
            _dispatch_mode(getattr(cls, method))["collect_fn"]
            is _dispatch_mode(getattr(cls.__base__, method))["collect_fn"]
        )
    assert vars(actor)["compute_log_prob"].__wrapped__ is ActorRolloutRefWorker.compute_log_prob
    # train_mini_batch runs the plan's steps, over verl's undecorated method
    assert inspect.unwrap(training.train_mini_batch) is inspect.unwrap(TrainingWorker.train_mini_batch)
    assert vars(training)["train_mini_batch"].__wrapped__ is not TrainingWorker.train_mini_batch
    assert training._postprocess_output.__wrapped__ is TrainingWorker._postprocess_output
    assert actor.actor_worker_cls is training and actor.__mro__[1] is ActorRolloutRefWorker
    # the classes odc runs use are built the same way, and are importable by name (Ray sends them so)
    from odc_plugin.verl import workers

    assert workers.ODCActorRolloutRefWorker.actor_worker_cls is workers.ODCTrainingWorker
    assert workers.ODCActorRolloutRefWorker.ref_worker_cls is workers.ODCTrainingWorker
    import cloudpickle

    assert b"odc_plugin.verl.workers" in cloudpickle.dumps(workers.ODCTrainingWorker)
    assert len(cloudpickle.dumps(workers.ODCTrainingWorker)) < 200  # a reference, not the class by value
    assert not _same(before, _verl_state())


@needs_trainer
@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_the_odc_trainer_extends_verls_trainer_and_changes_nothing_of_it(mode):
    """Every mode's stage methods are wrapped whole: separate_async's `_compute_old_log_prob`, which saves and
    restores the actor around a call of verl's base method, included."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    before = _verl_state()
    base = get_trainer_cls(mode)
    trainer = odc_patches.odc_subclass("trainer", base, "T", __name__)
    assert not _same(before, _verl_state())
    for method, _ in lb_mini_dispatch._STAGES:
        assert vars(trainer)[method].__wrapped__ is getattr(base, method)
    assert vars(trainer)["init"].__wrapped__ is base.init


def test_the_odc_detach_actor_worker_saves_and_restores_odc_as_fsdp2():
    """separate_async's actor worker: planned as the actor worker, and FSDP2's save and restore for odc, registered
    as verl's; verl's DetachActorWorker is left as it is."""
    import types

    from verl.utils import fsdp_utils

    from odc_plugin.verl import workers

    before = _verl_state()
    odc = workers.ODCDetachActorWorker
    assert odc.__mro__[1] is DetachActorWorker and workers.ACTOR_WORKERS[DetachActorWorker] is odc
    assert odc.actor_worker_cls is odc.ref_worker_cls is workers.ODCTrainingWorker
    for method in ("update_actor", "compute_log_prob", "compute_ref_log_prob"):
        assert _dispatch_mode(getattr(odc, method))["dispatch_fn"].func is lb_mini_dispatch._lb_mini_dispatch
    restore = odc.restore_model_from_cpu
    assert getattr(restore, MAGIC_ATTR) == getattr(DetachActorWorker.restore_model_from_cpu, MAGIC_ATTR)
    assert _dispatch_mode(restore) is Dispatch.ONE_TO_ALL
    worker = types.SimpleNamespace(config=types.SimpleNamespace(actor=types.SimpleNamespace(strategy="odc")))
    assert odc._get_strategy_handlers(worker) == (
        fsdp_utils.fsdp2_sharded_save_to_cpu,
        fsdp_utils.fsdp2_sharded_load_from_cpu,
    )
    worker.config.actor.strategy, worker._strategy_handlers = "odc-unknown", None
    with pytest.raises(NotImplementedError, match="Unsupported strategy: odc-unknown"):  # verl's own, for others
        odc._get_strategy_handlers(worker)
    assert not _same(before, _verl_state())


def test_detach_actor_patch_refuses_changed_verl(monkeypatch):
    def _get_strategy_handlers(self):  # a verl that picks its functions otherwise
        return None

    monkeypatch.setattr(DetachActorWorker, "_get_strategy_handlers", _get_strategy_handlers)
    with pytest.raises(PatchError, match=r"_get_strategy_handlers no longer uses \['strategy', 'fsdp2_sharded_save"):
        detach_actor.extend("actor_worker", DetachActorWorker, {})
    monkeypatch.undo()
    restore = DetachActorWorker.restore_model_from_cpu
    monkeypatch.setattr(
        DetachActorWorker, "restore_model_from_cpu", register(dispatch_mode=Dispatch.DP_COMPUTE)(restore.__wrapped__)
    )
    with pytest.raises(PatchError, match="restore_model_from_cpu is no longer ONE_TO_ALL"):
        detach_actor.extend("actor_worker", DetachActorWorker, {})
    members = {}
    detach_actor.extend("actor_worker", ActorRolloutRefWorker, members)  # not separate_async's worker: nothing
    assert not members


@pytest.mark.parametrize("name", PATCHES)
def test_other_verl_version_is_refused(monkeypatch, name):
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    kind, base = {
        "lb_mini_dispatch": ("actor_worker", ActorRolloutRefWorker),
        "detach_actor": ("actor_worker", DetachActorWorker),
    }.get(name, ("training_worker", TrainingWorker))
    members = {}
    with pytest.raises(PatchError, match=f"^odc patch '{name}' targets verl 0.9.1, but verl 0.9.2 is installed$"):
        importlib.import_module(f"odc_patches.{name}").extend(kind, base, members)
    assert not members  # a refusal adds nothing
    with pytest.raises(PatchError) as refused:
        odc_patches.odc_subclass("training_worker", TrainingWorker, "T", __name__)
    line = str(refused.value)
    assert "\n" not in line and "verl 0.9.1" in line and "verl 0.9.2 is installed" in line


# ---------------------------------------------------------------------------------------------
# lb_mini_worker, rank_metrics_agree: TrainingWorker
# ---------------------------------------------------------------------------------------------


def _extend(patch, base=TrainingWorker, kind="training_worker"):
    members = {}
    patch.extend(kind, base, members)
    return members


def test_rank_metrics_patch_refuses_a_changed_postprocess(monkeypatch):
    def _postprocess_output(self, output, *, global_token_num, delta_time, forward_only, images_seqlens):
        return {"metrics": {}}  # a rewrite that no longer takes per-rank readings

    monkeypatch.setattr(TrainingWorker, "_postprocess_output", _postprocess_output)
    with pytest.raises(PatchError, match="no longer reports"):
        _extend(rank_metrics_agree)
    monkeypatch.setattr(TrainingWorker, "_postprocess_output", lambda self, output, **kwargs: None)
    with pytest.raises(PatchError, match=r"_postprocess_output\(self, output, kwargs\) is not"):
        _extend(rank_metrics_agree)


def test_worker_patch_refuses_missing_method(monkeypatch):
    monkeypatch.delattr(TrainingWorker, "train_mini_batch")
    with pytest.raises(PatchError, match="train_mini_batch is gone"):
        _extend(lb_mini_worker)


def test_worker_patch_refuses_unregistered_method(monkeypatch):
    monkeypatch.setattr(TrainingWorker, "train_mini_batch", lambda self, data: None)
    with pytest.raises(PatchError, match="no longer registered"):
        _extend(lb_mini_worker)


def test_worker_patch_refuses_rewritten_method(monkeypatch):
    dispatch = _dispatch_mode(TrainingWorker.train_mini_batch)

    class TrainingWorker_:  # same qualname as verl's, new body
        def train_mini_batch(self, data):
            return self.train_batch(data)

    TrainingWorker_.train_mini_batch.__qualname__ = "TrainingWorker.train_mini_batch"
    monkeypatch.setattr(
        TrainingWorker, "train_mini_batch", register(dispatch_mode=dispatch)(TrainingWorker_.train_mini_batch)
    )
    with pytest.raises(PatchError, match="no longer uses"):
        _extend(lb_mini_worker)


def test_worker_patch_refuses_other_mini_batches(monkeypatch):
    """A train_mini_batch that still uses every name the patch relies on but forms its mini-batches
    otherwise (every rank shuffled alike): the driver's plans would train other samples than verl."""
    from verl.utils import tensordict_utils as tu

    dispatch = _dispatch_mode(TrainingWorker.train_mini_batch)

    class TrainingWorker_:
        def train_mini_batch(self, data):
            epochs = tu.pop(data, key="epochs", default=1)
            seed = tu.pop(data, key="seed", default=42)
            mini_batch_size_per_gpu = len(data)
            dataloader = tu.make_iterator(data, mini_batch_size_per_gpu, epochs, seed=seed)
            outputs = []
            with self.engine.train_mode():
                for mini_batch in dataloader:
                    outputs.append(self.train_batch(mini_batch))
            torch.distributed.all_gather_object(outputs, outputs)
            return Metric.aggregate_dp(outputs)

    TrainingWorker_.train_mini_batch.__qualname__ = "TrainingWorker.train_mini_batch"
    monkeypatch.setattr(
        TrainingWorker, "train_mini_batch", register(dispatch_mode=dispatch)(TrainingWorker_.train_mini_batch)
    )
    with pytest.raises(PatchError, match="no longer has 'mini_batch_size_per_gpu = batch_size_per_dp"):
        _extend(lb_mini_worker)


def test_worker_patch_refuses_changed_signature(monkeypatch):
    dispatch = _dispatch_mode(TrainingWorker.train_mini_batch)
    original = TrainingWorker.train_mini_batch.__wrapped__.__wrapped__

    @functools.wraps(original)
    def train_mini_batch(self, data, epochs):
        return original(self, data)

    del train_mini_batch.__wrapped__  # a real new signature, not one inspect would follow back to verl's
    monkeypatch.setattr(TrainingWorker, "train_mini_batch", register(dispatch_mode=dispatch)(train_mini_batch))
    with pytest.raises(PatchError, match=r"is not \(self, data\)"):
        _extend(lb_mini_worker)


def test_the_patches_read_verls_signatures_as_written_after_ray_made_an_actor_of_the_class(monkeypatch):
    """Ray's tracing gives every function of a class it makes an actor of a `__signature__` with an added
    `_ray_trace_ctx` (verl's driver does so for the critic's TrainingWorker before odc builds its subclass):
    the patches' checks read the code's own parameters, so a PPO run with a critic on odc is not refused."""
    import ray

    raw = TrainingWorker.train_mini_batch.__wrapped__.__wrapped__
    checked = (raw, TrainingWorker._postprocess_output)
    for fn in checked:  # restored after the test
        monkeypatch.setattr(fn, "__signature__", inspect.signature(fn), raising=False)
    ray.remote(TrainingWorker)
    assert all("_ray_trace_ctx" in inspect.signature(fn).parameters for fn in checked)
    _extend(lb_mini_worker)
    _extend(rank_metrics_agree)


# ---------------------------------------------------------------------------------------------
# lb_mini_dispatch: the workers' dispatch, the trainer's stages
# ---------------------------------------------------------------------------------------------


def test_dispatch_patch_refuses_other_dispatch_mode(monkeypatch):
    monkeypatch.setattr(
        ActorRolloutRefWorker, "update_actor", register(dispatch_mode=Dispatch.ONE_TO_ALL)(lambda self, data: None)
    )
    with pytest.raises(PatchError, match="update_actor is no longer registered with a dispatch dict"):
        _extend(lb_mini_dispatch, ActorRolloutRefWorker, "actor_worker")


def test_dispatch_patch_refuses_other_dispatch_function(monkeypatch):
    mode = _dispatch_mode(TrainingWorker.infer_batch)
    monkeypatch.setitem(mode, "dispatch_fn", functools.partial(mode["dispatch_fn"].func, "critic"))
    with pytest.raises(PatchError, match="infer_batch is no longer dispatched by dispatch_lazy_compute_data_proto"):
        _extend(lb_mini_dispatch)


@needs_trainer
def test_trainer_patch_refuses_missing_method(monkeypatch):
    from verl.trainer.ppo.v1 import PPOTrainer

    monkeypatch.delattr(PPOTrainer, "_compute_values")
    with pytest.raises(PatchError, match="_compute_values is gone"):
        _extend(lb_mini_dispatch, _trainer(), "trainer")


@needs_trainer
def test_trainer_patch_refuses_changed_signature(monkeypatch):
    monkeypatch.setattr(_trainer(), "_update_critic", lambda self, batch: batch)
    with pytest.raises(PatchError, match=r"PPOTrainerSync._update_critic\(self, batch\) is no longer"):
        _extend(lb_mini_dispatch, _trainer(), "trainer")


@needs_trainer
def test_trainer_patch_refuses_rewritten_update(monkeypatch):
    def _update_actor(self, batch, metrics):  # no longer calls actor_rollout_wg.update_actor
        return batch

    monkeypatch.setattr(_trainer(), "_update_actor", _update_actor)
    with pytest.raises(PatchError, match=r"_update_actor no longer uses \['update_actor'"):
        _extend(lb_mini_dispatch, _trainer(), "trainer")


# ---------------------------------------------------------------------------------------------
# trainer_choice: verl's trainer class, or its odc subclass, by the run's configuration
# ---------------------------------------------------------------------------------------------


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


@needs_trainer
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


@needs_trainer
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


@needs_trainer
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


@needs_trainer
def test_trainer_choice_gives_the_odc_subclass_for_odc(configs):
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    from odc_plugin.verl.trainer import trainer_class

    for mode in ("sync", "colocate_async", "separate_async"):
        for name in ("odc", "odc critic"):
            cls = trainer_class(get_trainer_cls(mode), configs[name])
            assert cls.__mro__[2] is get_trainer_cls(mode) and cls is trainer_class(cls, configs[name])
        assert type(PPOTrainer.__new__(get_trainer_cls(mode), config=configs["odc"])) is cls


@needs_trainer
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


@needs_trainer
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


@needs_trainer
def test_the_legacy_trainer_is_refused_where_the_v1_trainer_cannot_be_imported(monkeypatch, configs):
    """The legacy trainer does not need TransferQueue, which verl's v1 trainers import: its refusal comes first."""
    import sys

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from odc_plugin.verl.trainer import LEGACY_REFUSAL

    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.v1", None)  # as if it failed to import
    with pytest.raises(ValueError, match="^" + re.escape(LEGACY_REFUSAL) + "$"):
        RayPPOTrainer.__new__(RayPPOTrainer, config=configs["odc"])


@needs_trainer
def test_trainer_choice_on_another_verl_version_fails_odc_only(monkeypatch, configs):
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    monkeypatch.setattr(verl, "__version__", "0.9.2")
    assert type(PPOTrainer.__new__(get_trainer_cls("sync"), config=configs["fsdp2"])) is get_trainer_cls("sync")
    with pytest.raises(PatchError) as refused:
        PPOTrainer.__new__(get_trainer_cls("sync"), config=configs["odc"])
    assert str(refused.value) == (
        "strategy=odc needs verl 0.9.1, the version odc-verl's patches of verl were written for, but verl 0.9.2 "
        "is installed; install verl==0.9.1 for odc runs (runs of other strategies do not use the patches)"
    )


# ---------------------------------------------------------------------------------------------
# CPU patches (applied only with VERL_PLATFORM=cpu; tests/verl/test_cpu_mode.py checks the switch)
# ---------------------------------------------------------------------------------------------

from odc_patches import (  # noqa: E402
    CPU_PATCHES,
    cpu_layer_time,
    cpu_offload_unpinned,
    cpu_process_group,
    cpu_sharded_save,
    cpu_ulysses_sdpa,
    cpu_valuehead_attn,
    hf_rollout_registry,
)

# patch -> (module, attribute it replaces)
CPU_REPLACED = {
    "cpu_process_group": ("verl.workers.engine_workers", "initialize_global_process_group_ray"),
    "cpu_offload_unpinned": ("verl.workers.engine.fsdp.transformer_impl", "CPUOffloadPolicy"),
    "cpu_valuehead_attn": ("verl.utils.model", "load_valuehead_model"),
    "cpu_sharded_save": ("verl.utils.fsdp_utils", "fsdp2_sharded_save_to_cpu"),
}


@pytest.fixture
def stock_cpu(monkeypatch):
    """verl without the CPU patches; whatever a test changes is put back."""
    import importlib

    from verl.workers.rollout import base

    for module, attr in CPU_REPLACED.values():
        owner = importlib.import_module(module)
        current = getattr(owner, attr)
        monkeypatch.setattr(
            owner,
            attr,
            getattr(current, "__wrapped__", current) if getattr(current, "_odc_patched", False) else current,
        )
    registry = dict(base._ROLLOUT_REGISTRY)
    registry.pop(("hf", "async"), None)
    monkeypatch.setattr(base, "_ROLLOUT_REGISTRY", registry)
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    build = FSDPEngine._build_fsdp_module
    monkeypatch.setattr(FSDPEngine, "_build_fsdp_module", getattr(build, "__wrapped__", build))
    from transformers import AttentionInterface

    sdpa = AttentionInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", getattr(sdpa, "__wrapped__", sdpa))
    return monkeypatch


def test_cpu_patch_list():
    assert CPU_PATCHES == (
        "cpu_process_group",
        "cpu_offload_unpinned",
        "cpu_valuehead_attn",
        "hf_rollout_registry",
        "cpu_layer_time",
        "cpu_ulysses_sdpa",
        "cpu_batch_order",
        "cpu_replay_poll",
        "cpu_sharded_save",
    )
    for name in CPU_PATCHES:
        patch = importlib.import_module(f"odc_patches.{name}")
        assert patch.VERL_VERSION == "0.9.1"
        assert importlib.util.find_spec(patch.TARGET) is not None, patch.TARGET
    for name, (module, _) in CPU_REPLACED.items():
        assert getattr(odc_patches, name).TARGET == module


def test_cpu_patches_apply_to_stock_verl(stock_cpu, tmp_path):
    import importlib

    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.rollout.base import get_rollout_class

    from odc_plugin.verl.cpu.rollout import HFServerAdapter

    assert odc_patches.apply_all(CPU_PATCHES) == list(CPU_PATCHES)
    replaced = {name: getattr(importlib.import_module(m), a) for name, (m, a) in CPU_REPLACED.items()}
    assert all(getattr(fn, "_odc_patched", False) for fn in replaced.values())
    policy = replaced["cpu_offload_unpinned"](pin_memory=True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    assert get_rollout_class("hf", "async") is HFServerAdapter
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    assert FSDPEngine._build_fsdp_module._odc_patched
    from transformers import AttentionInterface

    assert AttentionInterface._global_mapping["sdpa"]._odc_patched  # Ulysses' head exchange under SDPA
    # the critic's value-head model loads with the attention its config names (stock verl forces
    # flash_attention_2, which is not installed here)
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
    ).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, attn_implementation="sdpa", num_labels=1)
    model = replaced["cpu_valuehead_attn"](
        str(tmp_path), torch_dtype=None, model_config=config, trust_remote_code=False
    )
    assert type(model).__name__ == "Qwen2ForTokenClassification" and model.config._attn_implementation == "sdpa"
    # applying again changes nothing
    odc_patches.apply_all(CPU_PATCHES)
    assert replaced == {name: getattr(importlib.import_module(m), a) for name, (m, a) in CPU_REPLACED.items()}


def test_cpu_patches_warn_on_other_verl_version(monkeypatch, caplog):
    """CPU mode serves fsdp2 runs too, which another verl version must not fail: its patches apply where
    their own checks of verl pass, after one warning per process (an odc patch refuses)."""
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    monkeypatch.setattr(odc_patches, "_warned_versions", set())
    with caplog.at_level(logging.WARNING, logger="odc_patches"):
        for name in CPU_PATCHES:
            odc_patches.require_verl_version(name, importlib.import_module(f"odc_patches.{name}").VERL_VERSION)
    assert [r.getMessage() for r in caplog.records] == [
        f"odc patch '{CPU_PATCHES[0]}' targets verl 0.9.1, but verl 0.9.2 is installed; the CPU patches apply "
        f"where their checks of verl pass (VERL_PLATFORM=cpu)"
    ]
    with pytest.raises(PatchError, match="targets verl 0.9.1, but verl 0.9.2"):
        odc_patches.require_verl_version(PATCHES[0])


def test_cpu_patches_refuse_changed_targets(stock_cpu):
    from verl.utils import model as model_utils
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.rollout import base

    stock_cpu.setattr(engine_workers, "initialize_global_process_group_ray", lambda timeout_second=None: None)
    with pytest.raises(PatchError, match="is not verl.utils.distributed's any more"):
        cpu_process_group.apply()
    stock_cpu.setattr(transformer_impl, "CPUOffloadPolicy", object)
    with pytest.raises(PatchError, match="CPUOffloadPolicy is not torch's any more"):
        cpu_offload_unpinned.apply()

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):  # fixed upstream
        return None

    stock_cpu.setattr(model_utils, "load_valuehead_model", load_valuehead_model)
    with pytest.raises(PatchError, match="no longer forces flash_attention_2"):
        cpu_valuehead_attn.apply()
    stock_cpu.setattr(base, "_ROLLOUT_REGISTRY", {})
    with pytest.raises(PatchError, match="no longer a dict keyed by"):
        hf_rollout_registry.apply()
    stock_cpu.setattr(transformer_impl.FSDPEngine, "_build_fsdp_module", lambda self, module, mesh: module)
    with pytest.raises(PatchError, match=r"_build_fsdp_module\(self, module, mesh\) is not \(self, module\)"):
        cpu_layer_time.apply()
    from verl.utils import ulysses

    stock_cpu.setattr(ulysses, "gather_seq_scatter_heads", lambda x, seq_dim, head_dim, group=None: x)
    with pytest.raises(PatchError, match=r"gather_seq_scatter_heads\(x, seq_dim, head_dim, group\) is not"):
        cpu_ulysses_sdpa.apply()
    from verl.utils import fsdp_utils

    stock_cpu.setattr(fsdp_utils, "fsdp2_sharded_save_to_cpu", lambda model: ({}, None))  # copies on CPU too now
    with pytest.raises(PatchError, match=r"fsdp2_sharded_save_to_cpu no longer takes the local shards .cpu\(\)"):
        cpu_sharded_save.apply()


def test_the_layer_time_patch_finds_the_decoder_layers_of_actor_and_critic_models():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    config = Qwen2Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        num_labels=1,
    )
    for model in (Qwen2ForCausalLM(config), Qwen2ForTokenClassification(config)):
        assert cpu_layer_time.decoder_layers(model) is model.model.layers
    with pytest.raises(ValueError, match="cpu_layer_time: found no decoder layers"):
        cpu_layer_time.decoder_layers(torch.nn.Linear(2, 2))
