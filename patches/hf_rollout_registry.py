"""Rollout `hf`'s in-worker adapter joins verl's table of rollout classes.

verl 0.9.1 finds the class a training rank builds for `rollout.name` in the private dict
`_ROLLOUT_REGISTRY[(name, mode)]` (`verl/workers/rollout/base.py`, read by `get_rollout_class`);
unlike rollout replicas (`RolloutReplicaRegistry.register`) it has no public way in. This patch adds
`("hf", "async")`. Applied only with VERL_PLATFORM=cpu, where rollout `hf` exists.
"""

from __future__ import annotations

from odc_patches import PatchError, require_attr

NAME = "hf_rollout_registry"
TARGET = "verl.workers.rollout.base"
ADAPTER = "odc_plugin.verl.cpu.rollout.HFServerAdapter"


def apply() -> None:
    from verl.workers.rollout import base

    registry = require_attr(base, "_ROLLOUT_REGISTRY", NAME)
    reader = require_attr(base, "get_rollout_class", NAME)
    if not isinstance(registry, dict) or ("vllm", "async") not in registry:
        raise PatchError(f"odc patch '{NAME}': _ROLLOUT_REGISTRY is no longer a dict keyed by (name, mode)")
    if "_ROLLOUT_REGISTRY" not in reader.__code__.co_names:
        raise PatchError(f"odc patch '{NAME}': get_rollout_class no longer reads _ROLLOUT_REGISTRY")
    registry[("hf", "async")] = ADAPTER
