"""On CPU, verl's training ranks join one plain gloo process group.

verl 0.9.1's process-group set-ups (`verl.utils.distributed`) build the backend string
`f"cpu:gloo,{device}:{backend}"`, which on the `cpu` platform is "cpu:gloo,cpu:gloo", and torch.distributed
rejects it ("Duplicate device type cpu"). Two callers: `ActorRolloutRefWorker.__init__` and the Ray
trainers' workers call `initialize_global_process_group_ray` with no backend (this patch makes the call
pass "gloo"); the SPMD SFT trainer (`torchrun -m verl.trainer.sft_trainer`) calls
`initialize_global_process_group`, which takes no backend (this patch gives its `init_process_group`
"gloo" for that string, and nothing else of it changes). Applied only with VERL_PLATFORM=cpu.
"""

from __future__ import annotations

import inspect

from odc_patches import PatchError, replace_attr, require_attr

NAME = "cpu_process_group"
TARGET = "verl.workers.engine_workers"
DUPLICATE_CPU = "cpu:gloo,cpu:gloo"


def _builds_duplicate_cpu(fn) -> bool:
    return "cpu:gloo," in "".join(c for c in fn.__code__.co_consts if isinstance(c, str))


def _check(fn, params: list[str]) -> None:
    if list(inspect.signature(fn).parameters) != params:
        raise PatchError(f"odc patch '{NAME}': {fn.__name__}{inspect.signature(fn)} is not ({', '.join(params)})")
    if not _builds_duplicate_cpu(fn):
        raise PatchError(
            f"odc patch '{NAME}': {fn.__name__} no longer builds 'cpu:gloo,<device>:<backend>'; re-check whether "
            f"CPU still needs this patch"
        )


def _gloo_ray_set_up(distributed, current):
    if current is not require_attr(distributed, "initialize_global_process_group_ray", NAME):
        raise PatchError(
            f"odc patch '{NAME}': engine_workers.initialize_global_process_group_ray is not "
            f"verl.utils.distributed's any more"
        )
    _check(current, ["timeout_second", "backend"])

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return current(timeout_second=timeout_second, backend=backend or "gloo")

    return initialize_global_process_group_ray


def _gloo_spmd_set_up(current):
    _check(current, ["timeout_second"])
    import torch.distributed as dist

    def initialize_global_process_group(timeout_second=36000):
        init = dist.init_process_group

        def gloo_for_duplicate_cpu(*args, backend=None, **kwargs):
            return init(*args, backend="gloo" if backend == DUPLICATE_CPU else backend, **kwargs)

        dist.init_process_group = gloo_for_duplicate_cpu
        try:
            return current(timeout_second=timeout_second)
        finally:
            dist.init_process_group = init

    return initialize_global_process_group


def apply() -> None:
    from verl.utils import distributed
    from verl.workers import engine_workers

    replace_attr(
        engine_workers,
        "initialize_global_process_group_ray",
        NAME,
        lambda current: _gloo_ray_set_up(distributed, current),
    )
    replace_attr(distributed, "initialize_global_process_group", NAME, _gloo_spmd_set_up)
