"""FSDP2's all-gather and reduce-scatter replaced, per parameter group, by ODC's gets and accumulates.

FSDP2 calls these in place of its collectives (`set_custom_all_gather`, `set_custom_reduce_scatter`).
Inside a mini-batch they reach the owners through the OnDemandComm that installed them (their `odc`: odc.py
imports this module, not the other way round); outside one they run the stock collectives, so evaluation
forwards between mini-batches stay as in FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _fsdp_internals as fsdp_internals
from ._fsdp_internals import AllGather, ReduceScatter


@dataclass(frozen=True)
class GroupLayout:
    """Where one FSDP parameter group lives in the symmetric regions."""

    group: object  # FSDPParamGroup
    param_offset: int  # bytes into the params region
    param_nbytes: int
    grad_offset: int  # elements into the grads region
    used_offset: int  # elements into the used flags, one per slot, which follow the accumulators
    slots: list[fsdp_internals.ParamSlot]


class _BufferAlloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class OnDemandAllGather(_BufferAlloc, AllGather):
    """FSDP all-gather replaced by gets from each owner's published shard."""

    def __init__(self, odc, layout: GroupLayout):
        self.odc, self.layout = odc, layout

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        odc, layout = self.odc, self.layout
        if not odc.in_minibatch:
            # Outside a mini-batch (evaluation, a stray forward) every rank takes part, as in stock FSDP2.
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        chunks = output_tensor.view(odc.world_size, -1)
        if chunks[0].numel() * chunks.element_size() != layout.param_nbytes:
            raise RuntimeError("FSDP's all-gather layout changed after apply_odc(); call apply_odc() again")
        if odc.config.lockstep:
            odc.transport.barrier(odc.config.barrier_timeout_s)
        for peer in odc.peers():
            odc.wait_published(peer)
            odc.transport.get(odc.params, peer, layout.param_offset, chunks[peer].view(torch.uint8))
        return None


class ScatterAccumulate(_BufferAlloc, ReduceScatter):
    """FSDP reduce-scatter replaced by accumulates into each owner's gradient accumulator.

    FSDP's input holds only the parameters this rank has a gradient for; which ones is known only as FSDP
    calls `reduced` for each of them, right after this hook. So the hook keeps the input, and the
    accumulates go out once those calls have covered all of it.

    On a GPU the accumulates run on the reduce-scatter stream, after the event FSDP records when this hook
    returns, which is all the compute stream waits for: FSDP would hand the input back to the caching
    allocator, for the next layer's backward, while the accumulates still read it. So ODC holds the input
    past them, with an event recorded after them, and the next group's reduce-scatter (its `allocate` of
    the input, on the compute stream), or else the end of the backward, makes compute wait for that event
    before letting go: compute never runs more than one group ahead of the accumulates, and the inputs in
    flight stay as few as FSDP2's own (one), however far the accumulates lag. The memory is reused in
    stream order, as FSDP2 reuses its own inputs, not held back for another stream (record_stream).
    """

    def __init__(self, odc, layout: GroupLayout):
        self.odc, self.layout = odc, layout
        self._input: torch.Tensor | None = None
        self._reduced: list[int] = []  # slot indices, in FSDP's order
        self._covered = 0  # elements of one rank's chunk that those slots fill

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # FSDP allocates the input on the compute stream, the output on the reduce-scatter stream.
        if self.odc._sent and fsdp_internals.on_compute_stream(self.layout.group, device):
            self.odc._wait_for_sent(torch.cuda.current_stream(device))
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        odc = self.odc
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"ODC expects FSDP to hand it a SUM reduce-scatter, got {op}")
        if not odc.in_minibatch:
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            if odc.mesh.replicate_group is not None:
                dist.all_reduce(output_tensor, group=odc.mesh.replicate_group)
            output_tensor.div_(odc.divide_factor)  # FSDP was told to divide nothing itself
            return None
        if not odc._backward:
            raise RuntimeError(
                "a backward inside a forward-only ODC mini-batch (begin(backward=False)); begin a backward one"
            )
        self.check_sent()
        self._input = input_tensor.view(odc.world_size, -1)
        self._reduced, self._covered = [], 0
        # FSDP adds the output into `.grad`; the real gradient arrives from the accumulator at end().
        output_tensor.zero_()
        return None

    def discard(self) -> None:
        """Drop a reduce-scatter a failed mini-batch left half reported."""
        self._input, self._reduced, self._covered = None, [], 0

    def check_sent(self) -> None:
        if self._input is not None:
            raise RuntimeError(
                "FSDP did not report which parameters a reduce-scatter held; ODC does not support this torch version"
            )

    def reduced(self, index: int, param) -> None:
        """FSDP reduced slot `index` (a post-accumulate-grad hook of its sharded parameter)."""
        if self._input is None:
            return  # a reduce-scatter outside a mini-batch, or autograd writing a sharded `.grad` itself
        self._reduced.append(index)
        self._covered += self.layout.slots[index].padded_numel
        if self._covered > self._input.shape[1]:
            raise RuntimeError("FSDP's reduce-scatter layout changed after apply_odc(); call apply_odc() again")
        if self._covered == self._input.shape[1]:
            self._send()

    def _send(self) -> None:
        odc, layout, chunks = self.odc, self.layout, self._input
        if odc.config.lockstep:
            odc.transport.barrier(odc.config.barrier_timeout_s)
        # Consecutive slots are contiguous in both FSDP's input and the accumulator: one accumulate per
        # run of them (a single run, the whole group, when every parameter got a gradient).
        runs: list[tuple[int, int, int]] = []  # (first slot, slots, column in the input)
        column = 0
        for index in self._reduced:
            if runs and runs[-1][0] + runs[-1][1] == index:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
            else:
                runs.append((index, 1, column))
            column += layout.slots[index].padded_numel
        for peer in [odc.rank, *odc.peers()]:
            odc.wait_published(peer)
            for first, count, column in runs:
                start, last = layout.slots[first], layout.slots[first + count - 1]
                numel = last.offset + last.padded_numel - start.offset
                odc.transport.accumulate(
                    odc.grads, peer, layout.grad_offset + start.offset, chunks[peer, column : column + numel]
                )
                odc.transport.accumulate(
                    odc.grads, peer, odc.grad_numel + layout.used_offset + first, odc._ones[:count]
                )
        if chunks.is_cuda:
            # Held, with what the compute stream will wait for, until the next reduce-scatter or the end of the
            # backward (see the class).
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(chunks.device))
            if not odc._waits_at_backward_end:
                odc._waits_at_backward_end = True
                fsdp_internals.at_end_of_backward(odc._end_of_backward)
            odc._sent.append((chunks, event))
        self._input = None  # the accumulates reading it are issued
