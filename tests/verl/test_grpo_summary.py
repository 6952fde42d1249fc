"""odc-grpo-cpu's one-line summary of a failed run names the exception that ended it."""

from __future__ import annotations

import pytest

from odc_plugin.verl.cpu import grpo, runner

ENGINE_START = """\
(TaskRunner pid=812) Traceback (most recent call last):
(TaskRunner pid=812)   File "/site-packages/verl/workers/engine_workers.py", line 620, in init_model
(TaskRunner pid=812)     self.actor = TrainingWorker(config=actor_training_config)
(TaskRunner pid=812) ValueError: fsdp_size=3 must divide the world size 4 and be at least 2 with strategy odc
(WorkerDict pid=901) /site-packages/verl/workers/engine/__init__.py:69: UserWarning: megatron engine is not \
available: ModuleNotFoundError("No module named 'megatron'")
(WorkerDict pid=901)   warnings.warn(f"megatron engine is not available: {e!r}", stacklevel=1)
"""
CHAINED = """\
Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in <module>
ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
"""
HYDRA = """\
Error executing job with overrides: ['a=1']
Error in call to target 'odc_plugin.verl.config.ODCEngineConfig':
ValueError("odc_transport must be one of auto, shm, cuda_ipc, nvshmem, got 'tcp'")
"""

# The end of an odc-grpo-cpu run in which training rank 1's micro-batch packing raised (injected): rank 0
# failed at once naming it; Ray surfaced rank 1's own exception, under which ODC's note says which rank.
RANK_FAILED_ITS_MINIBATCH = """\
(TaskRunnerV1 pid=18909) odc_plugin.comm.base.ODCPeerFailedError: rank 0: rank 1 failed in its mini-batch: \
RuntimeError: injected bad batch on training rank 1
ray.exceptions.RayTaskError(RuntimeError): ray::WorkerDict.actor_rollout_compute_log_prob() (pid=19063, ip=192.0.2.2)
  File "/work/main/odc_plugin/verl/engine.py", line 119, in forward_backward_batch
    micro_batches, indices = self._micro_batches(data)
RuntimeError: injected bad batch on training rank 1
ODC: rank 1 failed mini-batch 1, which failed on every rank
ODC: rank 1 failed mini-batch 1, which failed on every rank

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
(WorkerDict pid=19062) WARNING:2026-11-25 00:45:24,638:target_num_threads 8 should not exceed physical CPU cores 2.
"""


# The end of an odc-sft-cpu run given a key verl's config does not have (torchrun, 2 ranks): hydra refuses it
# with no exception line, and torchrun's ChildFailedError names nothing.
HYDRA_REFUSED = """\
  warnings.warn(f"megatron engine is not available: {e!r}", stacklevel=1)
Could not override 'engine.nonexistent_key'.
To append to your config use +engine.nonexistent_key=1
Key 'nonexistent_key' is not in struct
    full_key: engine.nonexistent_key
    object_type=dict

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
W1129 08:58:24.472000 11776 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 11780 closing
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
"""


@pytest.mark.parametrize(
    "log,expected",
    [
        (
            HYDRA_REFUSED,
            "Could not override 'engine.nonexistent_key'. To append to your config use +engine.nonexistent_key=1 "
            "Key 'nonexistent_key' is not in struct",
        ),
        (ENGINE_START, "ValueError: fsdp_size=3 must divide the world size 4 and be at least 2 with strategy odc"),
        (CHAINED, "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."),
        (HYDRA, "ValueError(\"odc_transport must be one of auto, shm, cuda_ipc, nvshmem, got 'tcp'\")"),
        (
            RANK_FAILED_ITS_MINIBATCH,
            "RuntimeError: injected bad batch on training rank 1 (ODC: rank 1 failed mini-batch 1, which failed on "
            "every rank)",
        ),
        ("step 1 done\nkilled\n", "killed"),
    ],
)
def test_the_summary_is_the_exception_that_ended_the_run_not_a_warning_after_it(tmp_path, log, expected):
    path = tmp_path / "run.log"
    path.write_text(log)
    assert grpo.last_error(str(path)) == expected


# The end of a CI run (2026-11-25) in which another process took verl's rendezvous port before rank 0 listened.
PORT_TAKEN = """\
(WorkerDict pid=5120)     store = TCPStore(
torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. \
port: 44217, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use
"""


@pytest.mark.parametrize(
    "log,returncode,steps,again",
    [
        (PORT_TAKEN, 1, 0, True),
        (PORT_TAKEN, 1, 1, False),  # it trained: starting again would lose that work's log and repeat it
        (ENGINE_START, 1, 0, False),  # a real error is reported, not retried
        ("step 1 done\n", 0, 1, False),
    ],
)
def test_only_a_run_whose_port_was_taken_before_its_first_step_starts_again(tmp_path, log, returncode, steps, again):
    path = tmp_path / "run.log"
    path.write_text(log)
    result = grpo.RunResult("odc", returncode, 1.0, 0.1, steps, str(path), "", "")
    assert runner.port_taken_at_start(result) is again
