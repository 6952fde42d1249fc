"""CPU harness that drives verl 0.9.1's own training engines on gloo ranks.

Everything here runs the code path main_ppo uses in 0.9.1 (the "engine workers"):
``verl.workers.engine_workers.TrainingWorker`` built from the same dataclass configs
``ActorRolloutRefWorker.init_model`` / ``PPOTrainer._setup`` build, then

* actor update   -> ``TrainingWorker.train_mini_batch`` (what ``ActorRolloutRefWorker.update_actor`` calls)
* old log-probs  -> ``TrainingWorker.infer_batch``      (what ``ActorRolloutRefWorker.compute_log_prob`` calls)
* critic update  -> ``TrainingWorker.train_mini_batch`` (what ``critic_wg.train_mini_batch`` calls)
* values         -> ``TrainingWorker.infer_batch``      (what ``critic_wg.infer_batch`` calls)

with the loss functions verl uses (``verl.workers.utils.losses.ppo_loss`` / ``value_loss``).
Ray, TransferQueue and rollout are not involved: the worker methods are called directly in
each rank (the ``@register`` wrappers pass plain TensorDicts straight through).

verl runs on CPU in the rank processes the way every CPU run of this project does it: with
``VERL_PLATFORM=cpu`` set before verl is imported, the plugin's ``odc_plugin.verl.cpu`` takes over
(platform, engines on device cpu, the CPU patches).

Typical use (functions passed to :func:`run_on_ranks` must be module-level, i.e. importable)::

    from tests.verl import harness as H

    def body(rank, world_size, model_dir):
        actor = H.build_engine("language_model", "fsdp2", model_dir)
        batch = H.make_grpo_batch(seed=0, batch_size=8, world_size=world_size, rank=rank)
        metrics = H.actor_update(actor, batch)
        return H.full_state_dict(actor)

    model_dir = H.make_tiny_qwen2(tmp_dir)
    states = H.run_on_ranks(body, 2, model_dir)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from odc_plugin.launch import run_ranks
from odc_plugin.verl.cpu import PLATFORM_ENV

# Defaults of the tiny model (a Qwen2 causal LM, fp32).
TINY_QWEN2 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
ATTN_IMPL = "sdpa"
PAD_TOKEN_ID = 0
# Where the ranks run: "cpu" (the default: verl on CPU, gloo, ODC's shm transport) or "cuda", which
# benchmarks/gpu_check.py sets on a GPU machine: verl on its own CUDA platform, rank r on GPU
# r % device_count (all on one GPU when there is one), ODC over CUDA IPC.
DEVICE_ENV = "ODC_TEST_DEVICE"
DEVICE = os.environ.get(DEVICE_ENV, "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"{DEVICE_ENV} must be cpu or cuda, got {DEVICE!r}")
# The plugin module a run of the `odc` engine imports in every rank (run_on_ranks' plugin_modules).
PLUGIN = ("odc_plugin.verl.plugin",)
# SGD keeps parameter deltas proportional to the gradient, so a wrong loss scale cannot hide behind Adam's
# normalization; 64 tokens per micro-batch give several micro-batches per rank (build_engine's kwargs).
SGD = {"max_token_len_per_gpu": 64, "lr": 1.0, "optim_kwargs": {"optimizer": "SGD", "weight_decay": 0.0}}


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args,
    plugin_modules: Sequence[str] = (),
    timeout_s: float = 600.0,
    pg_timeout_s: float = 300.0,
) -> list[Any]:
    """``odc_plugin.launch.run_ranks`` with verl on CPU in every rank (``VERL_PLATFORM=cpu``, then
    ``plugin_modules`` imported, e.g. ``["odc_plugin.verl.plugin"]``) before ``fn``'s module loads;
    with ``ODC_TEST_DEVICE=cuda``, verl on its own CUDA platform instead (see :data:`DEVICE`)."""
    if DEVICE == "cuda":
        setup, backend = partial(_cuda_rank_setup, tuple(plugin_modules)), cuda_backend(world_size)
    else:
        setup, backend = partial(_cpu_rank_setup, tuple(plugin_modules)), "gloo"
    return run_ranks(
        fn, world_size, *args, setup=setup, backend=backend, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s
    )


def _cpu_rank_setup(plugin_modules: tuple[str, ...]) -> None:
    import importlib

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ[PLATFORM_ENV] = "cpu"
    import verl  # noqa: F401  (loads the plugin's entry point, which turns verl's CPU support on)

    for module in plugin_modules:
        importlib.import_module(module)


def cuda_backend(world_size: int) -> str:
    """The ranks' process group on GPUs: verl's own ("cpu:gloo,cuda:nccl") when every rank has a GPU of
    its own; plain gloo when ranks share one, since NCCL refuses a communicator with two ranks on one GPU
    ("Duplicate GPU detected", NCCL 2.5 and later). gloo stages CUDA tensors through host memory for
    FSDP2's and verl's collectives; ODC itself runs none inside a mini-batch."""
    return "cpu:gloo,cuda:nccl" if world_size <= torch.cuda.device_count() else "gloo"


def _cuda_rank_setup(plugin_modules: tuple[str, ...]) -> None:
    import importlib
    import importlib.util

    import odc_patches
    from odc_plugin.verl.imports import after_import

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    import verl  # noqa: F401  (before the plugin, as on CPU; with no entry point installed it loads none)

    if importlib.util.find_spec("flash_attn") is None:
        # verl loads the critic's value-head model with flash-attention whatever the config says; without
        # it (the lent GPU machine has none) the critic loads with the config's sdpa, as on CPU
        odc_patches.apply_after_import(after_import, ("cpu_valuehead_attn",))
    for module in plugin_modules:
        importlib.import_module(module)


def _shares_a_gpu() -> bool:
    """A GPU rank in a gloo group (cuda_backend): ODC's transport `auto`, which picks by the group's
    backend, would take it for a CPU rank."""
    import torch.distributed as dist

    return DEVICE == "cuda" and "nccl" not in str(dist.get_backend())


# ---------------------------------------------------------------------------------------------
# tiny model
# ---------------------------------------------------------------------------------------------


def make_tiny_qwen2(out_dir: str, seed: int = 0, **overrides) -> str:
    """Build a random tiny fp32 Qwen2ForCausalLM and ``save_pretrained`` it under ``out_dir``.

    No tokenizer is written: the harness builds ``HFModelConfig(load_tokenizer=False)``.
    Returns the model directory.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg_kwargs = {**TINY_QWEN2, **overrides}
    config = Qwen2Config(
        **cfg_kwargs,
        architectures=["Qwen2ForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD_TOKEN_ID,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    path = os.path.join(out_dir, "tiny_qwen2")
    model.save_pretrained(path)
    return path


def load_hf_model(model_dir: str, model_type: str = "language_model"):
    """Plain single-process HF model in fp32 (reference for comparisons)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if model_type == "language_model":
        return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation=ATTN_IMPL)
    return AutoModelForTokenClassification.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation=ATTN_IMPL, num_labels=1
    )


# ---------------------------------------------------------------------------------------------
# engines (TrainingWorker, as main_ppo builds them)
# ---------------------------------------------------------------------------------------------


def _engine_config(engine_config_cls, strategy, forward_only, engine_kwargs):
    """Build the engine config the way verl's role configs do.

    ``FSDPActorConfig/FSDPCriticConfig.__post_init__`` copy the role's ``strategy`` onto the
    already-validated ``FSDPEngineConfig`` with ``object.__setattr__``, so an unknown strategy
    (e.g. "odc") reaches the engine without tripping ``FSDPEngineConfig.__post_init__``.
    We mimic that for strategies the config class does not accept.
    """
    from verl.workers.config import FSDPEngineConfig

    cls = engine_config_cls or FSDPEngineConfig
    kw = {
        "strategy": strategy,
        "forward_only": forward_only,
        "use_torch_compile": False,  # inductor on CPU is slow and irrelevant here
        "model_dtype": "fp32",
        "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        "use_no_sync_for_gradient_accumulation": False,  # the yaml default (engine/fsdp.yaml)
    }
    if strategy == "odc" and _shares_a_gpu():
        from odc_plugin.verl.config import ODCEngineConfig

        cls = engine_config_cls or ODCEngineConfig
        if issubclass(cls, ODCEngineConfig):
            kw["odc_transport"] = "cuda_ipc"
    kw.update(engine_kwargs or {})
    try:
        return cls(**kw)
    except AssertionError:
        kw["strategy"] = "fsdp2"
        cfg = cls(**kw)
        object.__setattr__(cfg, "strategy", strategy)
        return cfg


def build_engine(
    model_type: str,
    strategy: str,
    model_dir: str,
    *,
    lr: float = 1e-3,
    clip_grad: float = 1.0,
    use_dynamic_bsz: bool = True,
    max_token_len_per_gpu: int = 128,
    infer_max_token_len_per_gpu: int | None = None,
    micro_batch_size_per_gpu: int = 2,
    forward_only: bool = False,
    engine_config_cls: type | None = None,
    engine_kwargs: dict | None = None,
    optim_kwargs: dict | None = None,
    role_kwargs: dict | None = None,
    use_remove_padding: bool = True,
    enable_gradient_checkpointing: bool = False,
    seed: int = 0,
    attn_implementation: str = ATTN_IMPL,
):
    """Build and initialise a verl ``TrainingWorker`` for ``model_type`` with backend ``strategy``.

    Must run inside a rank process (see :func:`run_on_ranks`). Returns the TrainingWorker;
    ``worker.engine`` is the engine instance (``EngineRegistry.new(model_type, strategy, ...)``),
    ``worker.loss_fn`` is ``partial(ppo_loss, config=FSDPActorConfig)`` (language_model) or
    ``partial(value_loss, config=FSDPCriticConfig)`` (value_model), and ``worker.role_config``
    is that role config. A backend other than fsdp/fsdp2 must already be registered in
    ``EngineRegistry`` for device "cpu" (see :func:`register_engine_for_cpu`).

    Differences from main_ppo's yaml defaults, for CPU speed/exactness: fp32 params and reduce
    (``mixed_precision``), ``use_torch_compile=False``, gradient checkpointing off, sdpa attention.
    ``use_no_sync_for_gradient_accumulation=False`` as in ``engine/fsdp.yaml`` (the dataclass says True).

    ``engine_config_cls`` overrides the engine config dataclass (default ``FSDPEngineConfig``);
    ``engine_kwargs``/``optim_kwargs``/``role_kwargs`` are passed to the engine config,
    ``FSDPOptimizerConfig`` and the role config (``FSDPActorConfig``/``FSDPCriticConfig``).
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPCriticConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
    )
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss, value_loss

    assert model_type in ("language_model", "value_model"), model_type
    torch.manual_seed(seed)
    infer_max = infer_max_token_len_per_gpu or max_token_len_per_gpu

    model_config = HFModelConfig(
        path=model_dir,
        load_tokenizer=False,
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=enable_gradient_checkpointing,
        override_config={"attn_implementation": attn_implementation},
    )
    engine_cfg = _engine_config(engine_config_cls, strategy, forward_only, engine_kwargs)
    optim_cfg = FSDPOptimizerConfig(lr=lr, clip_grad=clip_grad, **(optim_kwargs or {}))

    role_args = {
        "strategy": strategy,
        "rollout_n": 1,
        "ppo_mini_batch_size": 1,
        "use_dynamic_bsz": use_dynamic_bsz,
        "ppo_max_token_len_per_gpu": max_token_len_per_gpu,
        "ppo_micro_batch_size_per_gpu": micro_batch_size_per_gpu,
        "optim": optim_cfg,
        **(role_kwargs or {}),
    }
    if model_type == "language_model":
        role_cfg = FSDPActorConfig(use_torch_compile=False, fsdp_config=engine_cfg, **role_args)
    else:
        role_cfg = FSDPCriticConfig(fsdp=engine_cfg, model=model_config, **role_args)
    engine_cfg = role_cfg.engine  # same object; its strategy now equals the role strategy

    # What ActorRolloutRefWorker.init_model / PPOTrainer._setup assign before building the worker.
    engine_cfg.use_dynamic_bsz = use_dynamic_bsz
    engine_cfg.max_token_len_per_gpu = max_token_len_per_gpu
    engine_cfg.infer_max_token_len_per_gpu = infer_max
    engine_cfg.micro_batch_size_per_gpu = micro_batch_size_per_gpu
    engine_cfg.infer_micro_batch_size_per_gpu = micro_batch_size_per_gpu
    engine_cfg.use_remove_padding = use_remove_padding

    if strategy == "odc":  # the worker class an odc run builds (odc_plugin/verl/trainer.py)
        from odc_plugin.verl.workers import ODCTrainingWorker as worker_cls
    else:
        worker_cls = TrainingWorker
    worker = worker_cls(
        config=TrainingWorkerConfig(
            model_type=model_type,
            model_config=model_config,
            engine_config=engine_cfg,
            optimizer_config=optim_cfg,
            checkpoint_config=CheckpointConfig(),
        )
    )
    worker.reset()  # -> engine.initialize()
    if not forward_only:
        loss = ppo_loss if model_type == "language_model" else value_loss
        worker.set_loss_fn(partial(loss, config=role_cfg))
    worker.role_config = role_cfg
    return worker


build_worker = build_engine  # alias: build_engine returns the TrainingWorker that owns the engine


# ---------------------------------------------------------------------------------------------
# synthetic GRPO batches
# ---------------------------------------------------------------------------------------------


def make_grpo_samples(
    seed: int,
    batch_size: int,
    *,
    group_size: int = 4,
    prompt_len: tuple[int, int] = (4, 12),
    response_len: tuple[int, int] = (2, 40),
    vocab_size: int = TINY_QWEN2["vocab_size"],
) -> list[dict[str, torch.Tensor]]:
    """Per-sample dicts in the v1 (TransferQueue) layout: every field is 1-D, variable length.

    Fields: prompts, responses, input_ids, attention_mask, position_ids, response_mask,
    loss_mask, old_log_probs, advantages (GRPO: per-group normalized scalar reward broadcast
    over the response), values, returns. ``uid`` groups consecutive ``group_size`` samples.
    Response lengths are drawn uniformly from ``response_len`` so they are uneven.
    """
    g = torch.Generator().manual_seed(seed)
    samples = []
    rewards = torch.randn(batch_size, generator=g)
    for start in range(0, batch_size, group_size):
        grp = rewards[start : start + group_size]
        norm = (grp - grp.mean()) / (grp.std(unbiased=True) + 1e-6) if len(grp) > 1 else grp * 0
        rewards[start : start + group_size] = norm
    for i in range(batch_size):
        pl = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        rl = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
        prompts = torch.randint(3, vocab_size, (pl,), generator=g)
        responses = torch.randint(3, vocab_size, (rl,), generator=g)
        input_ids = torch.cat([prompts, responses])
        resp_mask = torch.ones(rl, dtype=torch.int64)
        if rl > 3 and i % 3 == 0:  # some masked-out tail tokens, like tool/obs tokens
            resp_mask[-2:] = 0
        samples.append(
            {
                "prompts": prompts,
                "responses": responses,
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
                "position_ids": torch.arange(pl + rl),
                "response_mask": resp_mask,
                "loss_mask": resp_mask.clone(),
                "old_log_probs": -3.0 - torch.rand(rl, generator=g),
                "advantages": torch.full((rl,), float(rewards[i])),
                "values": 0.1 * torch.randn(rl, generator=g),
                "returns": torch.full((rl,), float(rewards[i])) + 0.1 * torch.randn(rl, generator=g),
            }
        )
    return samples


def samples_to_tensordict(samples: list[dict], non_tensor: dict | None = None):
    """Stack per-sample dicts like the v1 trainer does (``list_of_dict_to_tensordict`` -> jagged nested)."""
    from verl.utils import tensordict_utils as tu

    td = tu.list_of_dict_to_tensordict(samples)
    if non_tensor:
        tu.assign_non_tensor(td, **non_tensor)
    return td


def shard_for_rank(items: Sequence, rank: int, world_size: int) -> list:
    """Contiguous equal split, as verl's dispatch (``chunk``) does after ``_balance_batch``."""
    n = len(items)
    assert n % world_size == 0, f"{n} samples do not split evenly over {world_size} ranks"
    k = n // world_size
    return list(items[rank * k : (rank + 1) * k])


def make_grpo_batch(
    seed: int,
    batch_size: int,
    *,
    world_size: int = 1,
    rank: int = 0,
    indices: Sequence[int] | None = None,
    mini_batch_size: int | None = None,
    temperature: float = 1.0,
    max_token_len_per_gpu: int | None = None,
    micro_batch_size_per_gpu: int | None = None,
    epochs: int = 1,
    shuffle: bool = False,
    **sample_kwargs,
):
    """A synthetic GRPO actor/critic batch as the worker on ``rank`` receives it (v1 layout).

    The global batch (``batch_size`` samples from :func:`make_grpo_samples`) is the same on
    every rank for a given seed; this rank gets ``indices`` if given (e.g. an uneven LB-Mini
    share), else its contiguous ``1/world_size`` share. Non-tensor fields are those the v1
    trainer puts in ``extra_info`` for ``update_actor``: ``temperature``, ``global_batch_size``
    and ``mini_batch_size`` (global, = ppo_mini_batch_size * rollout.n; default whole batch),
    ``epochs``, ``seed``, ``dataloader_kwargs``. ``use_dynamic_bsz``/``max_token_len_per_gpu``
    are added only if given (otherwise TrainingWorker fills them from the engine config).
    """
    samples = make_grpo_samples(seed, batch_size, **sample_kwargs)
    idx = list(indices) if indices is not None else shard_for_rank(range(batch_size), rank, world_size)
    mbs = mini_batch_size or batch_size
    non_tensor = {
        "temperature": temperature,
        "global_batch_size": mbs,
        "mini_batch_size": mbs,
        "epochs": epochs,
        "seed": 42,
        "dataloader_kwargs": {"shuffle": shuffle},
        "calculate_entropy": False,
    }
    if max_token_len_per_gpu is not None:
        non_tensor.update(use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len_per_gpu)
    if micro_batch_size_per_gpu is not None:
        non_tensor.update(use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size_per_gpu)
    return samples_to_tensordict([samples[i] for i in idx], non_tensor)


# ---------------------------------------------------------------------------------------------
# operations (what the verl roles call)
# ---------------------------------------------------------------------------------------------


def _metrics_to_python(metrics: dict) -> dict:
    from verl.utils.metric.utils import Metric

    def conv(v):
        if isinstance(v, Metric):
            return v.aggregate()
        if isinstance(v, torch.Tensor):
            return v.detach().cpu().tolist()
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v

    return {k: conv(v) for k, v in metrics.items()}


def actor_update(worker, batch) -> dict:
    """One ``update_actor`` call: ``TrainingWorker.train_mini_batch`` with the ppo loss.

    With the default ``mini_batch_size == global_batch_size == len(global batch)`` this is
    exactly one optimizer step. Returns the metrics dict (values are lists per mini-batch /
    micro-batch, as the worker returns them; ``grad_norm``, ``loss``, ``actor/pg_loss``...).
    """
    from verl.utils import tensordict_utils as tu

    out = worker.train_mini_batch(batch.clone() if hasattr(batch, "clone") else batch)
    return _metrics_to_python(tu.get(out, "metrics")) if out is not None else {}


critic_update = actor_update  # same worker call; the worker's loss_fn is value_loss for critics


def train_step(worker, batch) -> dict:
    """One optimizer step on this rank's local ``batch`` via ``TrainingWorker.train_batch``.

    This is the per-mini-batch body of ``train_mini_batch`` without its iterator, so the local
    batch may have a different number of samples on each rank (an uneven LB-Mini share);
    ``global_batch_size`` in the batch must be the global mini-batch size. Like
    ``train_mini_batch`` it all-gathers the per-sequence token counts into ``global_token_num``
    (used for MFU only). Collective: call on every rank. Returns the metrics as
    ``TrainingWorker.train_batch`` gives them: ``loss``/``grad_norm`` are floats, the loss
    function's metrics are lists gathered over DP ranks (no per-mini-batch list level).
    """
    import torch.distributed as dist
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu

    data = batch.clone()
    for key in ("mini_batch_size", "epochs", "seed", "dataloader_kwargs", "num_mini_batch"):
        tu.pop(data, key=key, default=None)
    lens = data["input_ids"].offsets().diff().tolist()
    group = worker.engine.get_data_parallel_group()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, lens, group)
    tu.assign_non_tensor(
        data,
        global_token_num=NonTensorData([x for xs in gathered for x in xs]),
        update_lr_scheduler=False,
    )
    out = worker.train_batch(data)
    return _metrics_to_python(tu.get(out, "metrics")) if out is not None else {}


def count_micro_batches(worker) -> list[int]:
    """Instrument ``worker.engine.forward_step``; returns a list that grows by one per micro-batch call."""
    calls: list[int] = []
    engine = worker.engine
    original = engine.forward_step

    def counting_forward_step(micro_batch, loss_function, forward_only):
        calls.append(len(micro_batch))
        return original(micro_batch, loss_function=loss_function, forward_only=forward_only)

    engine.forward_step = counting_forward_step
    return calls


def _infer(worker, batch, key: str, **flags):
    from verl.utils import tensordict_utils as tu

    data = batch.clone()
    tu.assign_non_tensor(data, compute_loss=False, **flags)
    out = worker.infer_batch(data)
    nested = tu.get(out, key)
    return [t.detach().cpu().clone() for t in nested.unbind()]  # from a GPU rank too, to compare in the parent


def compute_log_probs(worker, batch, calculate_entropy: bool = False) -> list[torch.Tensor]:
    """``compute_log_prob``: per sample, log-probs of ``input_ids[1:]`` (length = seq_len, last is junk).

    Entry ``t`` of sample ``i`` is ``log p(input_ids[t+1] | input_ids[:t+1])``; the response
    slice verl uses is ``[prompt_len-1 : seq_len-1]`` (see :func:`response_slice`).
    """
    return _infer(worker, batch, "log_probs", calculate_entropy=calculate_entropy)


def compute_values(worker, batch) -> list[torch.Tensor]:
    """``compute_values`` (critic ``infer_batch``): per-token values, length = seq_len per sample."""
    return _infer(worker, batch, "values")


def response_slice(full: torch.Tensor, prompt_len: int, response_len: int) -> torch.Tensor:
    """Response part of a per-token model output, with verl's left shift (no_padding_2_padding)."""
    return full[prompt_len - 1 : prompt_len + response_len - 1]


def hf_log_probs(model, samples: Sequence[dict]) -> list[torch.Tensor]:
    """Reference: plain per-sequence HF forward, log p(input_ids[t+1] | ...) for t < len-1."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = s["input_ids"].unsqueeze(0)
            logits = model(input_ids=ids, position_ids=s["position_ids"].unsqueeze(0)).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
            out.append(lp)
    return out


def full_state_dict(worker) -> dict[str, torch.Tensor]:
    """Gathered full parameters of the worker's module (collective: call on every rank)."""
    from torch.distributed.tensor import DTensor

    module = worker.engine.module
    state = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        state[name] = t.detach().to("cpu", torch.float32).clone()
    return state


def assert_state_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """Two full_state_dicts hold the same parameters, equal to float32 round-off of sums in another order."""
    assert got.keys() == expected.keys(), what
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=f"{what}: {name}")


def exported_weights(worker) -> dict[str, torch.Tensor]:
    """Weights as exported to rollout (``engine.get_per_tensor_param()``), HF names."""
    gen, _ = worker.engine.get_per_tensor_param()
    return {k: v.detach().to("cpu", torch.float32).clone() for k, v in gen}
