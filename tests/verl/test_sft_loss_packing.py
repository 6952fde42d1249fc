"""verl's SFT loss under LB-Mini (odc_plugin/verl/engine.py): `sft_loss` shifts the loss mask over a packed
micro-batch as a whole, so a sample whose first token carries loss trains the sample packed before it to
predict that token, and LB-Mini packs other neighbours than fsdp2. On 2 CPU gloo ranks: a batch whose first
tokens carry no loss trains; one with a single such sample on one rank is refused by both ranks, before the
mini-batch starts, with one line naming what to change, and the engine trains the next batch as if the refused
one had never come; with a sample a micro-batch (no neighbour) the same batch trains."""

from __future__ import annotations

from functools import partial

import torch

from odc_plugin.verl.config import ODCEngineConfig
from tests.verl import harness as H


def _sft_batch(rank: int, first_token_loss: bool):
    """An SFT batch of 4 samples a rank: loss on the responses only, and on rank 1's first sample's first token
    too where asked."""
    samples = H.make_grpo_samples(rank, 4)
    for i, s in enumerate(samples):
        s["loss_mask"] = torch.cat([torch.zeros(len(s["prompts"]), dtype=torch.int64), s["response_mask"]])
        s["loss_mask"][0] = int(first_token_loss and rank == 1 and i == 0)
    return H.samples_to_tensordict(samples, {"temperature": 1.0, "global_batch_size": 8})


def _steps(rank, world_size, model_dir):
    from verl.workers.utils.losses import sft_loss

    worker = H.build_engine("language_model", "odc", model_dir, engine_config_cls=ODCEngineConfig)
    worker.set_loss_fn(partial(sft_loss, config=None))
    out = {}
    for name, first_token_loss in (("refused", True), ("trained", False)):
        try:
            out[name] = H.train_step(worker, _sft_batch(rank, first_token_loss))["grad_norm"]
        except Exception as e:  # noqa: BLE001  (the error is what the test checks)
            out[name] = f"{type(e).__name__}: {e}"
    fresh = H.build_engine("language_model", "odc", model_dir, engine_config_cls=ODCEngineConfig)
    fresh.set_loss_fn(partial(sft_loss, config=None))
    out["fresh"] = H.train_step(fresh, _sft_batch(rank, False))["grad_norm"]
    # a sample a micro-batch has no packed neighbour: the same batch trains
    alone = H.build_engine(
        "language_model",
        "odc",
        model_dir,
        engine_config_cls=ODCEngineConfig,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=1,
    )
    alone.set_loss_fn(partial(sft_loss, config=None))
    out["alone"] = H.train_step(alone, _sft_batch(rank, True))["grad_norm"]
    return out


def test_a_first_token_with_loss_is_refused_under_lb_mini_and_the_next_batch_trains(tmp_path):
    model_dir = H.make_tiny_qwen2(str(tmp_path))
    ranks = H.run_on_ranks(_steps, 2, model_dir, plugin_modules=H.PLUGIN)
    line = "1 samples' first token carries loss, which verl's sft_loss trains the sample packed before it to predict"
    assert line in ranks[1]["refused"] and "\n" not in ranks[1]["refused"], ranks[1]["refused"]
    assert ranks[1]["refused"].endswith(
        "leave each sample's first token out of loss_mask, or set odc_balancer=lb_micro"
    )
    assert ranks[0]["refused"].startswith("ODCPeerFailedError: ") and "rank 1" in ranks[0]["refused"], ranks[0]
    # the refused batch changed nothing: the next one trains as on a fresh engine
    assert all(r["trained"] == r["fresh"] > 0 for r in ranks), ranks
    assert all(isinstance(r["alone"], float) and r["alone"] > 0 for r in ranks), ranks
