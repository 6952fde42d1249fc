"""Every patch in `patches/` applies to the installed verl 0.9.1, and refuses (PatchError) when what it
replaces is missing or changed, or verl is another version. Checks run in-process on verl's own
objects; `monkeypatch` puts back whatever a test changes.
"""

from __future__ import annotations

import functools
import importlib.util

import odc_patches
import pytest
import verl
from odc_patches import PATCHES, PatchError, lb_mini_dispatch, lb_mini_worker
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None


def _trainer():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return PPOTrainer


def _dispatch_mode(method):
    return getattr(method, MAGIC_ATTR)["dispatch_mode"]


@pytest.fixture
def stock_verl(monkeypatch):
    """verl as installed, without this project's patches (restored after the test)."""
    current = TrainingWorker.train_mini_batch
    if getattr(current, "_odc_patched", False):
        monkeypatch.setattr(TrainingWorker, "train_mini_batch", current._odc_original)
    for method in (ActorRolloutRefWorker.update_actor, TrainingWorker.train_mini_batch):
        mode = _dispatch_mode(method)
        fn = mode["dispatch_fn"]
        if isinstance(fn, functools.partial) and fn.func is lb_mini_dispatch._lb_mini_dispatch:
            monkeypatch.setitem(mode, "dispatch_fn", fn.args[1])
    if HAS_TQ:
        trainer = _trainer()
        for name in ("_balance_batch", "_update_actor", "_update_critic"):
            fn = getattr(trainer, name)
            if getattr(fn, "_odc_patched", False):
                monkeypatch.setattr(trainer, name, fn.__wrapped__)
    return monkeypatch


def _patched_state():
    state = {
        "train_mini_batch": getattr(TrainingWorker.train_mini_batch, "_odc_patched", False),
        "dispatch": [
            getattr(_dispatch_mode(m)["dispatch_fn"], "func", None) is lb_mini_dispatch._lb_mini_dispatch
            for m in (ActorRolloutRefWorker.update_actor, TrainingWorker.train_mini_batch)
        ],
    }
    if HAS_TQ:
        trainer = _trainer()
        state["trainer"] = [getattr(getattr(trainer, n, None), "_odc_patched", False)
                            for n in ("_balance_batch", "_update_actor", "_update_critic")]
    return state


def test_patch_list():
    assert PATCHES == ("lb_mini_worker", "lb_mini_dispatch")
    for name in PATCHES:
        assert getattr(odc_patches, name).VERL_VERSION == verl.__version__ == "0.9.1"


def test_patches_apply_to_stock_verl(stock_verl):
    assert not any(v if isinstance(v, bool) else any(v) for v in _patched_state().values())
    assert odc_patches.apply_all() == list(PATCHES)
    state = _patched_state()
    assert state["train_mini_batch"] and all(state["dispatch"])
    if HAS_TQ:
        assert all(state["trainer"]) and lb_mini_dispatch.TRAINER_SKIPPED is None
    # the patched method is still a registered worker method with verl's dispatch dict
    attrs = getattr(TrainingWorker.train_mini_batch, MAGIC_ATTR)
    assert attrs["dispatch_mode"] is _dispatch_mode(TrainingWorker.train_mini_batch._odc_original)
    assert attrs["blocking"] is False
    # applying again (the plugin imported twice) changes nothing
    before = (TrainingWorker.train_mini_batch, dict(_dispatch_mode(ActorRolloutRefWorker.update_actor)))
    odc_patches.apply_all()
    assert before == (TrainingWorker.train_mini_batch, dict(_dispatch_mode(ActorRolloutRefWorker.update_actor)))


@pytest.mark.parametrize("name", PATCHES)
def test_other_verl_version_is_refused(stock_verl, name):
    stock_verl.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(PatchError, match="targets verl 0.9.1, but verl 0.9.2"):
        getattr(odc_patches, name).apply()
    with pytest.raises(PatchError, match="0.9.2"):
        odc_patches.apply_all()


# ---------------------------------------------------------------------------------------------
# lb_mini_worker: TrainingWorker.train_mini_batch
# ---------------------------------------------------------------------------------------------


def test_worker_patch_refuses_missing_method(stock_verl):
    stock_verl.delattr(TrainingWorker, "train_mini_batch")
    with pytest.raises(PatchError, match="train_mini_batch is gone"):
        lb_mini_worker.apply()


def test_worker_patch_refuses_unregistered_method(stock_verl):
    stock_verl.setattr(TrainingWorker, "train_mini_batch", lambda self, data: None)
    with pytest.raises(PatchError, match="no longer registered"):
        lb_mini_worker.apply()


def test_worker_patch_refuses_rewritten_method(stock_verl):
    dispatch = _dispatch_mode(TrainingWorker.train_mini_batch)

    class TrainingWorker_:  # same qualname as verl's, new body
        def train_mini_batch(self, data):
            return self.train_batch(data)

    TrainingWorker_.train_mini_batch.__qualname__ = "TrainingWorker.train_mini_batch"
    stock_verl.setattr(TrainingWorker, "train_mini_batch", register(dispatch_mode=dispatch)(TrainingWorker_.train_mini_batch))
    with pytest.raises(PatchError, match="no longer uses"):
        lb_mini_worker.apply()


def test_worker_patch_refuses_changed_signature(stock_verl):
    dispatch = _dispatch_mode(TrainingWorker.train_mini_batch)
    original = TrainingWorker.train_mini_batch.__wrapped__.__wrapped__

    @functools.wraps(original)
    def train_mini_batch(self, data, epochs):
        return original(self, data)

    del train_mini_batch.__wrapped__  # a real new signature, not one inspect would follow back to verl's
    stock_verl.setattr(TrainingWorker, "train_mini_batch", register(dispatch_mode=dispatch)(train_mini_batch))
    with pytest.raises(PatchError, match=r"is not \(self, data\)"):
        lb_mini_worker.apply()


# ---------------------------------------------------------------------------------------------
# lb_mini_dispatch: dispatch of the update calls, PPOTrainer
# ---------------------------------------------------------------------------------------------


def test_dispatch_patch_refuses_other_dispatch_mode(stock_verl):
    stock_verl.setattr(ActorRolloutRefWorker, "update_actor",
                       register(dispatch_mode=Dispatch.ONE_TO_ALL)(lambda self, data: None))
    with pytest.raises(PatchError, match="update_actor is no longer registered with a dispatch dict"):
        lb_mini_dispatch.apply()


def test_dispatch_patch_refuses_other_dispatch_function(stock_verl):
    mode = _dispatch_mode(TrainingWorker.train_mini_batch)
    stock_verl.setitem(mode, "dispatch_fn", functools.partial(mode["dispatch_fn"].func, "critic"))
    with pytest.raises(PatchError, match="train_mini_batch is no longer dispatched by dispatch_lazy_compute_data_proto"):
        lb_mini_dispatch.apply()


needs_trainer = pytest.mark.skipif(not HAS_TQ, reason="verl's v1 trainer module imports transfer_queue, which is "
                                                      "not installed (pip install TransferQueue==0.1.10)")


@needs_trainer
def test_trainer_patch_refuses_missing_method(stock_verl):
    stock_verl.delattr(_trainer(), "_balance_batch")
    with pytest.raises(PatchError, match="_balance_batch is gone"):
        lb_mini_dispatch.apply()
    # nothing was changed before the check failed
    assert not any(_patched_state()["dispatch"])


@needs_trainer
def test_trainer_patch_refuses_changed_signature(stock_verl):
    stock_verl.setattr(_trainer(), "_balance_batch", lambda self, batch, metrics: batch)
    with pytest.raises(PatchError, match=r"_balance_batch\(self, batch, metrics\) is no longer"):
        lb_mini_dispatch.apply()


@needs_trainer
def test_trainer_patch_refuses_rewritten_update(stock_verl):
    def _update_actor(self, batch, metrics):  # no longer calls actor_rollout_wg.update_actor
        return batch

    stock_verl.setattr(_trainer(), "_update_actor", _update_actor)
    with pytest.raises(PatchError, match=r"_update_actor no longer uses \['update_actor'"):
        lb_mini_dispatch.apply()


def test_trainer_patch_skipped_without_transfer_queue(stock_verl):
    stock_verl.setattr(lb_mini_dispatch, "TRAINER_SKIPPED", lb_mini_dispatch.TRAINER_SKIPPED)  # put back after
    find_spec = importlib.util.find_spec
    stock_verl.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transfer_queue" else find_spec(name, *a))
    lb_mini_dispatch.apply()
    assert "TransferQueue" in lb_mini_dispatch.TRAINER_SKIPPED
    assert all(_patched_state()["dispatch"])
