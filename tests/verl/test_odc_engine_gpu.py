"""verl's `odc` engine on GPUs as verl runs it: one rank per GPU in verl's own process group (NCCL for
CUDA tensors), ODC's transport left to `auto`, against verl's `fsdp2` engine in the same processes: the
log-probs and one actor update agree (tests/verl/harness.py with ODC_TEST_DEVICE=cuda; the `verl-engine-nccl`
step of benchmarks/gpu_check.py). On a machine with one GPU that is one rank; the other engine tests run
there with ranks sharing the GPU in a gloo group, since NCCL takes one rank per GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.verl import harness as H

pytestmark = pytest.mark.skipif(
    H.DEVICE != "cuda" or not torch.cuda.is_available(),
    reason=f"needs a CUDA GPU and {H.DEVICE_ENV}=cuda (benchmarks/gpu_check.py sets it)",
)

SEED = 0


def _body(rank, world_size, model_dir):
    import torch.distributed as dist

    batch = H.make_grpo_batch(SEED, 4 * world_size, world_size=world_size, rank=rank)
    out = {"backend": str(dist.get_backend())}
    for strategy in ("fsdp2", "odc"):
        actor = H.build_engine("language_model", strategy, model_dir, **H.SGD)
        res = out[strategy] = {"log_probs": H.compute_log_probs(actor, batch)}
        if strategy == "odc":
            res["transport"] = type(actor.engine.odc.transport).__name__
        H.actor_update(actor, batch)
        res["after"] = H.full_state_dict(actor)
        del actor
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = H.make_tiny_qwen2(str(tmp_path_factory.mktemp("model")))
    return H.run_on_ranks(_body, torch.cuda.device_count(), model_dir, plugin_modules=H.PLUGIN)


def test_auto_picks_cuda_ipc_in_verls_nccl_group(runs):
    for rank, r in enumerate(runs):
        assert "nccl" in r["backend"] and r["odc"]["transport"] == "CudaIpcTransport", (rank, r["backend"])


def test_log_probs_and_the_actor_update_equal_fsdp2(runs):
    for r in runs:
        for got, expected in zip(r["odc"]["log_probs"], r["fsdp2"]["log_probs"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        H.assert_state_close(r["odc"]["after"], r["fsdp2"]["after"], "actor")
