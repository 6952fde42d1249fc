"""A long sample split over a group of ranks inside verl's FSDP engine (`odc_split=auto`): Ulysses sequence
parallelism for that one micro-batch, none for the others.

verl fixes its Ulysses state when the engine is built: the process-wide group its attention patch and its
input slicing read (`verl.utils.ulysses`), and the engine's `use_ulysses_sp` and
`ulysses_sequence_parallel_size`, by which `prepare_model_inputs` pads and slices the packed inputs and
`_gather_and_unpad_packed` gathers the outputs back. A split micro-batch runs, forward and backward (a
forward recomputed under gradient checkpointing runs inside the backward), with that state set to its
group's; then the engine's own state is back. verl's attention patch is in place whenever
`use_remove_padding` is (`apply_monkey_patch`), which odc_split requires.

A split sample counts once: every member computes the whole sample's loss from the gathered outputs, and
verl's gather scales the gradient by the group size (its fixed groups' ranks all divide FSDP's average), so
the members' gradients sum to k times the sample's. Each member therefore backpropagates a k-th of the loss
and reports a k-th of it and of its summed metrics, and the mini-batch's token count takes the sample from
its group's first member only.

The groups are `SequenceGroups` (odc_plugin.fsdp.ulysses), every aligned block of ranks, built once with
the engine; the planner (odc_plugin.balance.split) picks one per split sample, and the trainer puts the
split samples first in each member's data, their groups under `SPLIT_KEY`.
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric

from ..balance.split import UlyssesModel
from ..fsdp.ulysses import SequenceGroups
from .config import as_odc_config
from .dispatch import SPLIT_STEPS_KEY

# non-tensor entry of a rank's data: the ranks of the group of each of its leading (split) samples
SPLIT_KEY = "odc_split_ranks"


def split_model(hf_config, world_size: int, odc_config) -> UlyssesModel:
    """The groups a sample may be split over: what the model's heads allow (as verl's Ulysses checks
    them), inside one node (the ranks verl's Ray workers have on theirs, `RAY_LOCAL_WORLD_SIZE`, or
    torchrun's `LOCAL_WORLD_SIZE`); their all-to-alls priced as the engine config gives them."""
    per_node = int(os.environ.get("RAY_LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    return UlyssesModel.from_config(
        hf_config,
        gpus_per_node=min(per_node, world_size),
        bandwidth=odc_config.odc_split_bandwidth,
        latency_s=odc_config.odc_split_latency_s,
    )


class SplitMicroBatches:
    """An engine's split micro-batches: its groups (collective: every rank builds them, in the same order)."""

    def __init__(self, engine):
        if hasattr(engine.model_config.hf_config, "vision_config"):
            raise ValueError("odc_split=auto does not split a vision-language model's inputs; set odc_split=off")
        if not engine.use_remove_padding:
            raise ValueError("odc_split=auto runs verl's Ulysses attention, which needs model.use_remove_padding=True")
        self.model = split_model(
            engine.model_config.hf_config, dist.get_world_size(), as_odc_config(engine.engine_config)
        )
        largest = self.model.group_sizes(dist.get_world_size())[-1]
        self.groups = SequenceGroups(largest) if largest > 1 else None

    @staticmethod
    def give(data, groups: list[list[int]]) -> None:
        """Mark `data`'s leading samples as split over `groups` (the trainers' side of `take`)."""
        if groups:
            tu.assign_non_tensor(data, **{SPLIT_KEY: tuple(tuple(int(r) for r in g) for g in groups)})

    @staticmethod
    def counted_elsewhere(groups: list[list[int]]) -> list[int]:
        """The leading split samples this rank holds as a later member of their group: their tokens count on
        the group's first member alone."""
        rank = dist.get_rank()
        return [i for i, g in enumerate(groups) if g[0] != rank]

    @staticmethod
    def take(data) -> list[list[int]]:
        """The groups of `data`'s leading split samples (removed from it; none when nothing is split): an
        update's step has them from `give`, a forward-only pass from its plan's one step."""
        steps = tu.pop(data, key=SPLIT_STEPS_KEY, default=None)
        groups = tu.pop(data, key=SPLIT_KEY, default=None) or (steps[0] if steps else [])
        return [list(g) for g in groups]

    @staticmethod
    def split_off(data, groups: list[list[int]]):
        """`data`'s split samples, one micro-batch each, and the rest of it (None when nothing is left)."""
        n = len(groups)
        singles = [tu.index_select_tensor_dict(data, [i]) for i in range(n)]
        rest = tu.index_select_tensor_dict(data, list(range(n, len(data)))) if len(data) > n else None
        return singles, rest

    @staticmethod
    def others_tokens(data, groups: list[list[int]]):
        """The loss tokens of the split samples counted on another rank (`counted_elsewhere`)."""
        later = SplitMicroBatches.counted_elsewhere(groups)
        return tu.index_select_tensor_dict(data, later)["loss_mask"].sum() if later else 0

    @contextlib.contextmanager
    def running(self, engine, ranks: list[int]):
        """verl's Ulysses state set to the group `ranks` for one micro-batch."""
        from verl.utils.ulysses import get_ulysses_sequence_parallel_group, set_ulysses_sequence_parallel_group

        if self.groups is None:
            raise ValueError(f"odc_split: a sample split over ranks {ranks}, but this model's heads allow no group")
        saved = get_ulysses_sequence_parallel_group(), engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size
        with self.groups.split(ranks) as member:
            set_ulysses_sequence_parallel_group(member.group)
            engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = True, member.size
            try:
                yield member
            finally:
                set_ulysses_sequence_parallel_group(saved[0])
                engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = saved[1:]

    @staticmethod
    def count_once(loss, meta: dict, k: int):
        """A member's part of a split sample's loss, reported loss and summed metrics: a k-th."""
        meta["loss"] = meta["loss"] / k
        for value in (meta.get("metrics") or {}).values():
            if isinstance(value, Metric) and value.aggregation == AggregationType.SUM:
                value.values = [v / k for v in value.values]
        return loss / k
