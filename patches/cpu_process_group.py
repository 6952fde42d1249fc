"""On CPU, verl's training ranks join one plain gloo process group.

verl 0.9.1 (`verl/utils/distributed.py:83-99`) builds the backend string
`f"cpu:gloo,{device}:{backend}"`, which on the `cpu` platform is "cpu:gloo,cpu:gloo", and
torch.distributed rejects it ("Duplicate device type cpu"). `ActorRolloutRefWorker.__init__`
(`verl/workers/engine_workers.py:89`) calls it with no backend; this patch makes that call pass "gloo".
Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

import functools
import inspect

from odc_patches import PatchError, require_attr, require_verl_version

VERL_VERSION = "0.9.1"
NAME = "cpu_process_group"
TARGET = "verl.workers.engine_workers"


def apply() -> None:
    require_verl_version(NAME, VERL_VERSION)
    from verl.utils import distributed
    from verl.workers import engine_workers

    current = require_attr(engine_workers, "initialize_global_process_group_ray", NAME)
    if getattr(current, "_odc_patched", False):
        return
    if current is not require_attr(distributed, "initialize_global_process_group_ray", NAME):
        raise PatchError(
            f"odc patch '{NAME}': engine_workers.initialize_global_process_group_ray is not "
            f"verl.utils.distributed's any more"
        )
    if list(inspect.signature(current).parameters) != ["timeout_second", "backend"]:
        raise PatchError(
            f"odc patch '{NAME}': initialize_global_process_group_ray{inspect.signature(current)} "
            f"is not (timeout_second, backend)"
        )
    if "cpu:gloo," not in "".join(c for c in current.__code__.co_consts if isinstance(c, str)):
        raise PatchError(
            f"odc patch '{NAME}': initialize_global_process_group_ray no longer builds "
            f"'cpu:gloo,<device>:<backend>'; re-check whether CPU still needs this patch"
        )

    @functools.wraps(current)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return current(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._odc_patched = True
    engine_workers.initialize_global_process_group_ray = initialize_global_process_group_ray
