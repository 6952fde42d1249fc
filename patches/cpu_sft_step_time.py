"""On CPU, verl's SFT trainers report each step's time, so that two runs can be compared (`odc-sft-cpu`).

verl 0.9.1's SFT trainers log no time; the v1 PPO trainer logs `timing_s/step`. Both SFT trainers call
`TrainingWorker.train_batch` once per step, first thing after reading the step's batch; this patch adds to
its metrics `timing_s/update` (the call itself: forward, backward, optimizer step) and `timing_s/step`
(from the previous call's end to this one's: the previous step's logging and validation, this step's batch
and update; none at the first call). Every strategy alike; applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

import inspect
import time

from odc_patches import PatchError, parameters, replace_attr, require_attr

NAME = "cpu_sft_step_time"
TARGET = "verl.workers.engine_workers"


def apply() -> None:
    from verl.workers import engine_workers

    worker = require_attr(engine_workers, "TrainingWorker", NAME)
    replace_attr(worker, "train_batch", NAME, _timed)


def _timed(current):
    found = parameters(inspect.unwrap(current))  # under verl's register and profiler decorators
    if found != ["self", "data"]:
        raise PatchError(f"odc patch '{NAME}': TrainingWorker.train_batch({', '.join(found)}) is not (self, data)")

    def train_batch(self, data):
        start = time.perf_counter()
        output = current(self, data)
        end = time.perf_counter()
        previous, self._odc_last_end = getattr(self, "_odc_last_end", None), end
        if output is not None:
            from verl.utils import tensordict_utils as tu

            metrics = tu.get(output, "metrics")
            metrics["timing_s/update"] = end - start
            if previous is not None:
                metrics["timing_s/step"] = end - previous
        return output

    return train_batch
