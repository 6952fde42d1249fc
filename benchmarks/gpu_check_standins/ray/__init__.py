"""A stand-in for Ray, on the import path only in the verl steps of benchmarks/gpu_check.py.

verl 0.9.1's engine modules import Ray when they load (`verl.protocol`, `verl.single_controller.ray`,
the checkpoint-engine and rollout modules `verl.workers.engine_workers` imports), and Ray's wheel alone
(79 MB) is larger than all that may travel to the lent GPU machine (64 MiB). The engine tests
(tests/verl/harness.py) call the workers' methods directly in each rank, without Ray. What they need
of it: the names verl's modules use while loading (in annotations and imports, and `@ray.remote` on a
function), and `ray.is_initialized()`, which verl asks before it reads the local rank from the
environment. Anything else raises when called, naming the call, so a use of Ray on that path shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import actor  # noqa: F401  (verl reads `ray.actor.ActorHandle` off the package)


def absent(name: str) -> Callable[..., Any]:
    """A function of Ray's that the stand-in does not provide: calling it raises, naming it."""

    def call(*_args, **_kwargs):
        raise RuntimeError(
            f"ray.{name}() called, but this is benchmarks/gpu_check_standins/ray, which only satisfies "
            "verl's imports: verl's engine tests run without Ray"
        )

    call.__name__ = name.rpartition(".")[2]
    return call


class ObjectRef:
    """Named in annotations (`verl.protocol.DataProtoFuture`)."""


def is_initialized() -> bool:
    return False


def remote(target):
    """`@ray.remote` (on `verl.single_controller.ray.base.get_master_addr_port`) leaves it as it is."""
    return target
