"""The patches for odc runs (patches/lb_mini_worker.py, lb_mini_dispatch.py, rank_metrics_agree.py,
detach_actor.py) change nothing of verl's: they only extend the subclasses odc runs use
(odc_patches.odc_subclass), each refuses (PatchError) when what it builds on is missing or changed, and
another verl version fails them all, in one line, before any of them runs. Checks run in-process on verl's
own objects; `monkeypatch` puts back whatever a test changes. The trainer choice: test_trainer_choice.py;
the CPU patches: test_cpu_patches.py.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import pytest
import torch
import verl
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base import decorator
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, dispatch_lazy_compute_data_proto, register
from verl.utils.metric import Metric
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

import odc_patches
from odc_patches import PATCHES, PatchError, detach_actor, lb_mini_dispatch, lb_mini_worker, rank_metrics_agree

from .requires import HAS_TQ, needs_transfer_queue


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


def test_patch_list_and_the_one_verl_version():
    assert PATCHES == ("lb_mini_worker", "lb_mini_dispatch", "rank_metrics_agree", "detach_actor")
    assert odc_patches.PATCHED_VERL_VERSION == verl.__version__ == odc_patches.installed_verl() == "0.9.1"
    for name in PATCHES:
        patch = importlib.import_module(f"odc_patches.{name}")
        assert callable(patch.extend) and not hasattr(patch, "apply")  # they extend subclasses, never verl
        assert not hasattr(patch, "VERL_VERSION")  # no version of its own: PATCHED_VERL_VERSION


@pytest.mark.parametrize("kind", odc_patches.KINDS)
def test_another_verl_version_fails_odc_runs_in_one_line_before_any_patch_runs(other_verl, monkeypatch, kind):
    ran = []
    for name in PATCHES:
        module = importlib.import_module(f"odc_patches.{name}")
        monkeypatch.setattr(module, "extend", lambda *args, name=name: ran.append(name))
    before = _verl_state()
    with pytest.raises(PatchError) as refused:
        odc_patches.odc_subclass(kind, TrainingWorker, "T", __name__)
    assert str(refused.value) == (
        "strategy=odc needs verl 0.9.1, the version odc-verl's patches of verl were written for, but verl 0.9.2 "
        "is installed; install verl==0.9.1 for odc runs (runs of other strategies do not use the patches)"
    )
    assert not ran and not _same(before, _verl_state())


def test_verls_version_is_read_once_per_process(monkeypatch):
    """Read at the first check and kept: every later check of the process compares with that reading."""
    odc_patches.installed_verl.cache_clear()
    assert odc_patches.installed_verl() == "0.9.1"
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    odc_patches.require_odc_verl()  # the process's reading stands
    assert odc_patches.installed_verl() == "0.9.1"
    odc_patches.installed_verl.cache_clear()
    with pytest.raises(PatchError, match="but verl 0.9.2 is installed"):
        odc_patches.require_odc_verl()
    monkeypatch.undo()
    odc_patches.installed_verl.cache_clear()


def test_odc_subclasses_extend_verl_and_change_nothing_of_it():
    before = _verl_state()
    training = odc_patches.odc_subclass("training_worker", TrainingWorker, "T", __name__)
    actor = odc_patches.odc_subclass("actor_worker", ActorRolloutRefWorker, "A", __name__, actor_worker_cls=training)
    assert not _same(before, _verl_state())
    # the worker methods are verl's, registered again with the plan's dispatch in front of verl's and
    # verl's collect behind collect_once
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
        collect = _dispatch_mode(getattr(cls, method))["collect_fn"]  # verl's, each split sample's outputs once
        assert collect.func is lb_mini_dispatch._collect_once
        assert collect.args == (_dispatch_mode(getattr(cls.__base__, method))["collect_fn"],)
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


@needs_transfer_queue
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
    for patch in (lb_mini_worker, rank_metrics_agree):
        patch.extend("training_worker", TrainingWorker, {})


# ---------------------------------------------------------------------------------------------
# refusals: verl changed under a patch
# ---------------------------------------------------------------------------------------------


def _like_verls(cls, method: str, fn, qualname: str | None = None):
    """`fn` registered with the dispatch mode verl registers `cls.method` with (and, given, verl's qualname)."""
    if qualname:
        fn.__qualname__ = qualname
    return register(dispatch_mode=_dispatch_mode(getattr(cls, method)))(fn)


def _rewritten(self, data):  # verl's qualname, a new body
    return self.train_batch(data)


def _reshuffled(self, data):
    """Uses every name the patch relies on but forms its mini-batches otherwise (every rank shuffled alike): the
    driver's plans would train other samples than verl."""
    from verl.utils import tensordict_utils as tu

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


def _with_epochs():
    original = TrainingWorker.train_mini_batch.__wrapped__.__wrapped__

    @functools.wraps(original)
    def train_mini_batch(self, data, epochs):
        return original(self, data)

    del train_mini_batch.__wrapped__  # a real new signature, not one inspect would follow back to verl's
    return train_mini_batch


def _no_readings(self, output, *, global_token_num, delta_time, forward_only, images_seqlens):
    return {"metrics": {}}  # a rewrite that no longer takes per-rank readings


def _no_update_actor_call(self, batch, metrics):  # no longer calls actor_rollout_wg.update_actor
    return batch


def _other_dispatch_function(mp):
    mode = _dispatch_mode(TrainingWorker.infer_batch)
    mp.setitem(mode, "dispatch_fn", functools.partial(mode["dispatch_fn"].func, "critic"))


def _without_compute_values(mp):
    from verl.trainer.ppo.v1 import PPOTrainer

    mp.delattr(PPOTrainer, "_compute_values")


W, A, D = TrainingWorker, ActorRolloutRefWorker, DetachActorWorker
# id -> (the change to verl, the patch, kind, the base it extends (None: the sync trainer), what the refusal says)
REFUSALS = {
    "worker: train_mini_batch gone": (
        lambda mp: mp.delattr(W, "train_mini_batch"),
        lb_mini_worker,
        "training_worker",
        W,
        "train_mini_batch is gone",
    ),
    "worker: train_mini_batch not registered": (
        lambda mp: mp.setattr(W, "train_mini_batch", lambda self, data: None),
        lb_mini_worker,
        "training_worker",
        W,
        "no longer registered",
    ),
    "worker: train_mini_batch rewritten": (
        lambda mp: mp.setattr(
            W, "train_mini_batch", _like_verls(W, "train_mini_batch", _rewritten, "TrainingWorker.train_mini_batch")
        ),
        lb_mini_worker,
        "training_worker",
        W,
        "no longer uses",
    ),
    "worker: other mini-batches": (
        lambda mp: mp.setattr(
            W, "train_mini_batch", _like_verls(W, "train_mini_batch", _reshuffled, "TrainingWorker.train_mini_batch")
        ),
        lb_mini_worker,
        "training_worker",
        W,
        "no longer has 'mini_batch_size_per_gpu = batch_size_per_dp",
    ),
    "worker: train_mini_batch's signature": (
        lambda mp: mp.setattr(W, "train_mini_batch", _like_verls(W, "train_mini_batch", _with_epochs())),
        lb_mini_worker,
        "training_worker",
        W,
        r"is not \(self, data\)",
    ),
    "metrics: no per-rank readings": (
        lambda mp: mp.setattr(W, "_postprocess_output", _no_readings),
        rank_metrics_agree,
        "training_worker",
        W,
        "no longer reports",
    ),
    "metrics: _postprocess_output's signature": (
        lambda mp: mp.setattr(W, "_postprocess_output", lambda self, output, **kwargs: None),
        rank_metrics_agree,
        "training_worker",
        W,
        r"_postprocess_output\(self, output, kwargs\) is not",
    ),
    "dispatch: another dispatch mode": (
        lambda mp: mp.setattr(A, "update_actor", register(dispatch_mode=Dispatch.ONE_TO_ALL)(lambda self, data: None)),
        lb_mini_dispatch,
        "actor_worker",
        A,
        "update_actor is no longer registered with a dispatch dict",
    ),
    "dispatch: another dispatch function": (
        _other_dispatch_function,
        lb_mini_dispatch,
        "training_worker",
        W,
        "infer_batch is no longer dispatched by dispatch_lazy_compute_data_proto",
    ),
    "dispatch: another collect function": (
        lambda mp: mp.setattr(decorator, "collect_lazy_compute_data_proto", lambda worker_group, output: output),
        lb_mini_dispatch,
        "training_worker",
        W,
        r"collect_lazy_compute_data_proto\(worker_group, output\) changed",
    ),
    "detach: strategy handlers picked otherwise": (
        lambda mp: mp.setattr(D, "_get_strategy_handlers", lambda self: None),
        detach_actor,
        "actor_worker",
        D,
        r"_get_strategy_handlers no longer uses \['strategy', 'fsdp2_sharded_save",
    ),
    "detach: restore not ONE_TO_ALL": (
        lambda mp: mp.setattr(
            D,
            "restore_model_from_cpu",
            register(dispatch_mode=Dispatch.DP_COMPUTE)(D.restore_model_from_cpu.__wrapped__),
        ),
        detach_actor,
        "actor_worker",
        D,
        "restore_model_from_cpu is no longer ONE_TO_ALL",
    ),
    "trainer: _compute_values gone": (
        _without_compute_values,
        lb_mini_dispatch,
        "trainer",
        None,
        "_compute_values is gone",
    ),
    "trainer: _update_critic's signature": (
        lambda mp: mp.setattr(_trainer(), "_update_critic", lambda self, batch: batch),
        lb_mini_dispatch,
        "trainer",
        None,
        r"PPOTrainerSync._update_critic\(self, batch\) is no longer",
    ),
    "trainer: _update_actor rewritten": (
        lambda mp: mp.setattr(_trainer(), "_update_actor", _no_update_actor_call),
        lb_mini_dispatch,
        "trainer",
        None,
        r"_update_actor no longer uses \['update_actor'",
    ),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=needs_transfer_queue if c.startswith("trainer") else ()) for c in REFUSALS]
)
def test_a_patch_refuses_a_verl_changed_under_it_in_one_line(monkeypatch, case):
    change, patch, kind, base, refusal = REFUSALS[case]
    change(monkeypatch)
    members = {}
    with pytest.raises(PatchError, match=refusal) as refused:
        patch.extend(kind, base or _trainer(), members)
    assert str(refused.value).startswith(f"odc patch '{patch.NAME}': ") and "\n" not in str(refused.value)


def test_the_detach_patch_extends_separate_asyncs_actor_worker_alone():
    members = {}
    detach_actor.extend("actor_worker", ActorRolloutRefWorker, members)  # not separate_async's worker: nothing
    assert not members
