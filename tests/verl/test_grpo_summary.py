"""odc-grpo-cpu's one-line summary of a failed run names the exception that ended it."""

from __future__ import annotations

import pytest

from odc_plugin.verl.cpu import grpo

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


@pytest.mark.parametrize(
    "log,expected",
    [
        (ENGINE_START, "ValueError: fsdp_size=3 must divide the world size 4 and be at least 2 with strategy odc"),
        (CHAINED, "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."),
        (HYDRA, "ValueError(\"odc_transport must be one of auto, shm, cuda_ipc, nvshmem, got 'tcp'\")"),
        ("step 1 done\nkilled\n", "killed"),
    ],
)
def test_the_summary_is_the_exception_that_ended_the_run_not_a_warning_after_it(tmp_path, log, expected):
    path = tmp_path / "run.log"
    path.write_text(log)
    assert grpo.last_error(str(path)) == expected
