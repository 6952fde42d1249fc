"""Every patch in `patches/` applies to the installed verl 0.9.1, and refuses (PatchError) when what it
replaces is missing or changed, or verl is another version. Checks run in-process on verl's own
objects; `monkeypatch` puts back whatever a test changes.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import verl
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register
from verl.utils.metric import Metric
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

import odc_patches
from odc_patches import PATCHES, PatchError, lb_mini_dispatch, lb_mini_worker

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None


def _trainer():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return PPOTrainer


def _dispatch_mode(method):
    return getattr(method, MAGIC_ATTR)["dispatch_mode"]


@pytest.fixture
def stock_verl(monkeypatch):
    """verl as installed, without this project's patches (restored after the test)."""
    if HAS_TQ:
        _trainer()  # imported first: the plugin patches the trainer (and its dispatch) when it is imported
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
        for name, _ in lb_mini_dispatch._STAGES:
            fn = getattr(trainer, name)
            if getattr(fn, "_odc_patched", False):
                monkeypatch.setattr(trainer, name, fn.__wrapped__)
    post = TrainingWorker._postprocess_output
    if getattr(post, "_odc_patched", False):
        monkeypatch.setattr(TrainingWorker, "_postprocess_output", post.__wrapped__)
    return monkeypatch


def _patched_state():
    state = {
        "train_mini_batch": getattr(TrainingWorker.train_mini_batch, "_odc_patched", False),
        "postprocess": getattr(TrainingWorker._postprocess_output, "_odc_patched", False),
        "dispatch": [
            getattr(_dispatch_mode(m)["dispatch_fn"], "func", None) is lb_mini_dispatch._lb_mini_dispatch
            for m in (ActorRolloutRefWorker.update_actor, TrainingWorker.train_mini_batch)
        ],
    }
    if HAS_TQ:
        trainer = _trainer()
        state["trainer"] = [
            getattr(getattr(trainer, n, None), "_odc_patched", False) for n, _ in lb_mini_dispatch._STAGES
        ]
    return state


def test_patch_list():
    assert PATCHES == ("lb_mini_worker", "lb_mini_dispatch", "rank_metrics_agree")
    for name in PATCHES:
        assert getattr(odc_patches, name).VERL_VERSION == verl.__version__ == "0.9.1"


def test_patches_apply_to_stock_verl(stock_verl):
    assert not any(v if isinstance(v, bool) else any(v) for v in _patched_state().values())
    assert odc_patches.apply_all() == list(PATCHES)
    state = _patched_state()
    assert state["train_mini_batch"] and all(state["dispatch"]) and state["postprocess"]
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


def test_rank_metrics_patch_refuses_a_changed_postprocess(stock_verl):
    from odc_patches import rank_metrics_agree

    def _postprocess_output(self, output, *, global_token_num, delta_time, forward_only, images_seqlens):
        return {"metrics": {}}  # a rewrite that no longer takes per-rank readings

    stock_verl.setattr(TrainingWorker, "_postprocess_output", _postprocess_output)
    with pytest.raises(PatchError, match="no longer reports"):
        rank_metrics_agree.apply()
    stock_verl.setattr(TrainingWorker, "_postprocess_output", lambda self, output, **kwargs: None)
    with pytest.raises(PatchError, match=r"_postprocess_output\(self, output, kwargs\) is not"):
        rank_metrics_agree.apply()


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
    stock_verl.setattr(
        TrainingWorker, "train_mini_batch", register(dispatch_mode=dispatch)(TrainingWorker_.train_mini_batch)
    )
    with pytest.raises(PatchError, match="no longer uses"):
        lb_mini_worker.apply()


def test_worker_patch_refuses_other_mini_batches(stock_verl):
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
    stock_verl.setattr(
        TrainingWorker, "train_mini_batch", register(dispatch_mode=dispatch)(TrainingWorker_.train_mini_batch)
    )
    with pytest.raises(PatchError, match="no longer has 'mini_batch_size_per_gpu = batch_size_per_dp"):
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
    stock_verl.setattr(
        ActorRolloutRefWorker, "update_actor", register(dispatch_mode=Dispatch.ONE_TO_ALL)(lambda self, data: None)
    )
    with pytest.raises(PatchError, match="update_actor is no longer registered with a dispatch dict"):
        lb_mini_dispatch.apply()


def test_dispatch_patch_refuses_other_dispatch_function(stock_verl):
    mode = _dispatch_mode(TrainingWorker.train_mini_batch)
    stock_verl.setitem(mode, "dispatch_fn", functools.partial(mode["dispatch_fn"].func, "critic"))
    with pytest.raises(
        PatchError, match="train_mini_batch is no longer dispatched by dispatch_lazy_compute_data_proto"
    ):
        lb_mini_dispatch.apply()


needs_trainer = pytest.mark.skipif(
    not HAS_TQ,
    reason="verl's v1 trainer module imports transfer_queue, which is "
    "not installed (pip install TransferQueue==0.1.10)",
)


@needs_trainer
def test_trainer_patch_refuses_missing_method(stock_verl):
    stock_verl.delattr(_trainer(), "_compute_values")
    with pytest.raises(PatchError, match="_compute_values is gone"):
        lb_mini_dispatch.apply()
    # nothing was changed before the check failed
    assert not any(_patched_state()["dispatch"])


@needs_trainer
def test_trainer_patch_refuses_changed_signature(stock_verl):
    stock_verl.setattr(_trainer(), "_update_critic", lambda self, batch: batch)
    with pytest.raises(PatchError, match=r"_update_critic\(self, batch\) is no longer"):
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
    stock_verl.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transfer_queue" else find_spec(name, *a)
    )
    lb_mini_dispatch.apply()
    assert "TransferQueue" in lb_mini_dispatch.TRAINER_SKIPPED
    assert all(_patched_state()["dispatch"])


# ---------------------------------------------------------------------------------------------
# CPU patches (applied only with VERL_PLATFORM=cpu; tests/verl/test_cpu_mode.py checks the switch)
# ---------------------------------------------------------------------------------------------

from odc_patches import (  # noqa: E402
    CPU_PATCHES,
    cpu_layer_time,
    cpu_offload_unpinned,
    cpu_process_group,
    cpu_ulysses_sdpa,
    cpu_valuehead_attn,
    hf_rollout_registry,
)

# patch -> (module, attribute it replaces)
CPU_REPLACED = {
    "cpu_process_group": ("verl.workers.engine_workers", "initialize_global_process_group_ray"),
    "cpu_offload_unpinned": ("verl.workers.engine.fsdp.transformer_impl", "CPUOffloadPolicy"),
    "cpu_valuehead_attn": ("verl.utils.model", "load_valuehead_model"),
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
    )
    for name in CPU_PATCHES:
        patch = getattr(odc_patches, name)
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


@pytest.mark.parametrize("name", CPU_PATCHES)
def test_cpu_patch_refuses_other_verl_version(stock_cpu, name):
    stock_cpu.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(PatchError, match="targets verl 0.9.1, but verl 0.9.2"):
        getattr(odc_patches, name).apply()


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
