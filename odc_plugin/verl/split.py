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

verl exchanges a group's tokens in its flash-attention patch only (and odc's CPU patch in SDPA): under any
other attention kernel, or in a layer that mixes tokens outside attention (linear attention, convolutions,
state-space layers), each member would see its own slice alone, and nothing would fail. So instead of a list
of kernels and layers, `check` runs the model at start on a sequence whole and split over the smallest group,
through the engine's own pass, and refuses the split unless both compute the same.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.utils.metric import AggregationType, Metric

from ..balance.split import UlyssesModel
from ..fsdp.ulysses import SequenceGroups
from .config import as_odc_config, is_vision_language
from .dispatch import SPLIT_STEPS_KEY

# non-tensor entry of a rank's data: the ranks of the group of each of its leading (split) samples
SPLIT_KEY = "odc_split_ranks"
# The start-up check's sequence: not a multiple of any group size, so that verl pads the slices. Split, its
# outputs may differ from its outputs whole by at most ROUNDING times what rounding alone moves them (the
# sequence whole again, packed before another one: other kernel shapes), or CONTEXT times what its first slice
# moves them (the same sequence with that slice's tokens drawn again), whichever is more. A member that does not
# see the others' slices moves them by about all of the latter; a convolution that does not reach over a slice
# boundary, by 1e-3 of it in a tiny model.
CHECK_LENGTH = 45
ROUNDING = 10.0
CONTEXT = 1e-4


def _free_device_bytes() -> int:
    """Free memory of this rank's GPU; 0 on CPU, where the groups hold none of it."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


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
        if is_vision_language(engine.model_config.hf_config):
            raise ValueError("odc_split=auto does not split a vision-language model's inputs; set odc_split=off")
        if not engine.use_remove_padding:
            raise ValueError("odc_split=auto runs verl's Ulysses attention, which needs model.use_remove_padding=True")
        self.model = split_model(
            engine.model_config.hf_config, dist.get_world_size(), as_odc_config(engine.engine_config)
        )
        sizes = self.model.group_sizes(dist.get_world_size())
        # A member that raises inside a split micro-batch leaves the others in its group's next exchange: they
        # leave it within half the barrier timeout, inside the time the ranks' recovery meeting waits for them.
        self._timeout_s = as_odc_config(engine.engine_config).odc_barrier_timeout_s / 2
        self.metrics: dict[str, float] = {}  # the groups' and the start-up check's figures
        self.groups = self._groups(sizes[-1]) if sizes[-1] > 1 else None
        self.smallest = sizes[1] if len(sizes) > 1 else None
        self._stale = False  # a pass failed: its groups may hold a member's unread messages

    def _groups(self, largest: int) -> SequenceGroups:
        """The groups, connected now; they stay for the engine's life, through the rollout too: the device
        memory their connections took (NCCL's communicators) is a metric, `odc/split/groups_bytes`."""
        free = _free_device_bytes()
        groups = SequenceGroups(largest, self._timeout_s)
        groups.connect(get_device_id())
        self.metrics["odc/split/groups"] = float(len(groups.blocks))
        self.metrics["odc/split/groups_bytes"] = float(max(0, free - _free_device_bytes()))
        return groups

    def check(self, engine) -> None:
        """Refuses, on every rank alike and in one line, a model whose outputs a split changes (the module's
        docstring says why). A collective of every rank of the engine, in its eval mode."""
        if self.smallest is None:
            return
        start = time.perf_counter()
        k, rank = self.smallest, dist.get_rank()
        g = torch.Generator().manual_seed(0)
        vocab = engine.model_config.hf_config.get_text_config().vocab_size
        sequence = torch.randint(vocab, (CHECK_LENGTH,), generator=g)
        first = -(-CHECK_LENGTH // k)  # the first member's slice
        other = torch.cat([torch.randint(vocab, (first,), generator=g), sequence[first:]])
        after = torch.randint(vocab, (CHECK_LENGTH // 3,), generator=g)
        # split; then in pairs, the sequence first (causal layers keep what follows out of it): whole, moved |
        # packed, after
        rows = [sequence, sequence, other, sequence, after]
        fields = {"input_ids": rows, "position_ids": [torch.arange(len(r)) for r in rows]}
        fields.update(attention_mask=[torch.ones_like(r) for r in rows], loss_mask=[torch.ones_like(r) for r in rows])
        data = tu.get_tensordict(
            {key: torch.nested.as_nested_tensor(column, layout=torch.jagged) for key, column in fields.items()},
            {"temperature": 1.0, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
        )
        block = list(range(rank - rank % k, rank - rank % k + k))
        self.give(data, [block])  # the first copy split over this rank's block, the others whole
        outputs = engine.forward_backward_batch(data, loss_function=None, forward_only=True)["model_output"]
        split, whole, moved, packed, _ = (t.float().flatten() for t in next(iter(outputs.values())).unbind())
        # the last position's output is verl's roll around the micro-batch; before `first` the moved one saw other
        # tokens
        figures = [(split - whole)[:-1], (packed - whole)[:-1], (moved - whole)[first:-1]]
        figures = [f.abs().max() for f in figures] + [torch.tensor(time.perf_counter() - start)]
        figures = torch.stack(figures).to(get_device_id())
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # every rank decides alike
        difference, rounding, context, seconds = figures.tolist()
        self.metrics["odc/split/check_s"] = seconds
        self.metrics["odc/split/check_difference"] = difference / max(context, 1e-30)
        if not difference <= max(ROUNDING * rounding, CONTEXT * context):
            attention = getattr(engine.model_config.hf_config, "_attn_implementation", None)
            raise ValueError(
                f"odc_split=auto: this model computes a sequence split over {k} ranks otherwise than whole (outputs "
                f"{difference:.3g} apart, where rounding moves them by {rounding:.3g} and its first tokens by "
                f"{context:.3g}): verl exchanges the sequence between ranks only in flash attention, and this model "
                f"runs attn_implementation={attention} or mixes tokens outside attention; use flash_attention_2, or "
                "set odc_split=off"
            )

    @contextlib.contextmanager
    def renewed(self):
        """One pass of the engine, its groups made again first if the last pass failed (collective: a failed
        pass fails on every rank, so every rank makes them again)."""
        if self._stale and self.groups is not None:
            largest = max(map(len, self.groups.blocks))
            self.groups.close()
            self.groups = self._groups(largest)
        self._stale = False
        try:
            yield
        except BaseException:
            self._stale = True
            raise

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
            except Exception as error:
                # a member that failed first left this one in an exchange until its timeout: that failure is
                # what ended it
                if (first := engine.odc.transport.peer_failure()) is not None:
                    raise first from error
                raise
            finally:
                set_ulysses_sequence_parallel_group(saved[0])
                engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = saved[1:]

    @staticmethod
    def count_once(loss, meta: dict, group: list[int]):
        """A member's part of a split sample's loss, reported loss and summed metrics: a k-th; its averaged
        metrics, which every member computes alike from the gathered outputs, on the group's first member
        alone (a mean weighs each micro-batch, and the sample is one)."""
        k = len(group)
        meta["loss"] = meta["loss"] / k
        later = group[0] != dist.get_rank()
        for value in (meta.get("metrics") or {}).values():
            if isinstance(value, Metric) and value.aggregation == AggregationType.SUM:
                value.values = [v / k for v in value.values]
            elif isinstance(value, Metric) and value.aggregation == AggregationType.MEAN and later:
                value.values = []
        return loss / k
