"""A trained ODC model's gradient accumulator as the storage of its sharded `.grad`.

Stock FSDP2 keeps each sharded parameter's gradient in `.grad`; under ODC the peers add their gradient
shards into the owner's fp32 accumulator instead. For an fp32 parameter the accumulator's slice *is* the
`.grad` the optimizer reads (a view), so ODC holds no gradient memory that FSDP2 does not. For another
parameter dtype (bf16 parameters without a mixed-precision policy) `.grad` must have that dtype: it is
a copy, allocated before the mini-batch's outcome is decided (so that running out of memory fails the
mini-batch on every rank, not this rank alone after its peers succeeded), and the accumulator is extra.

During a mini-batch `.grad` must not be the accumulator: FSDP's post-backward adds each reduce-scatter
output into an existing `.grad` with a plain read-modify-write, which would race with the peers' adds
into the same memory. So begin() points every `.grad` at one shared block of zeros (ODC zeroes FSDP's
outputs, so FSDP's adds keep it zero, and FSDP keeps no gradient buffer of its own alive), and end()
points them back at the accumulator. The block (the largest shard's size, per parameter dtype) exists
only during a backward mini-batch.

When ODC releases its regions between phases (`OnDemandComm.release`), a `.grad` that is the accumulator
gets a copy of its own first (`detach`): what FSDP2 would hold, and begin() adds it back in like any
`.grad` carried into a mini-batch.

The accumulator holds plain sums, divided once at end(). A `.grad` carried into a mini-batch (gradient
accumulation over mini-batches, a backward outside one) is scaled back into the sum at begin(); under
HSDP only the first replica carries it in, since end() sums the replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ._fsdp_internals import ParamSlot


def _as_grad_of(param, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


@dataclass(frozen=True)
class _Slot:
    param: torch.nn.Parameter  # a sharded DTensor parameter
    start: int  # elements into the accumulator
    padded_numel: int  # elements the accumulator reserves for it
    slice: torch.Tensor | None  # its accumulator slice, shaped as its local shard (fp32 parameters), else None

    def is_view(self, grad: DTensor) -> bool:
        """Whether `grad` is this slot's accumulator slice. By address, not by object: moving a module
        (`model.to(device)`, as verl's parameter offload does) swaps a `.grad` tensor's data in place."""
        local = grad.to_local()
        return (
            self.slice is not None and local.device == self.slice.device and local.data_ptr() == self.slice.data_ptr()
        )


class GradientStorage:
    """The accumulator `region` (gradients, then one used flag per slot) behind the `.grad` of `slots`,
    each (ParamSlot, start of its gradient in the region). `carries`: whether this rank adds the
    gradients carried into a mini-batch to the sum (False on all HSDP replicas but the first)."""

    def __init__(self, region: torch.Tensor, slots: list[tuple[ParamSlot, int]], carries: bool):
        self.acc, self.flags = region[: -len(slots)], region[-len(slots) :]
        self.region, self.carries = region, carries
        self.slots: list[_Slot] = []
        for slot, start in slots:
            param, local = slot.param, slot.param.to_local()
            mine = self.acc[start : start + local.numel()].view(local.shape) if local.dtype == torch.float32 else None
            self.slots.append(_Slot(param, start, slot.padded_numel, mine))
        self._zeros: list[torch.Tensor] = []  # the blocks `.grad` points at during a mini-batch, one per dtype
        self._had = [False] * len(self.slots)  # whose `.grad` was set when the mini-batch began
        self._copies: list[DTensor | None] = [None] * len(self.slots)  # `.grad` to be of the copied ones

    @property
    def grad_storage_bytes(self) -> int:
        """Bytes of sharded `.grad` that the accumulator stands in for: what FSDP2 holds and ODC does not."""
        return sum(s.slice.numel() * 4 for s in self.slots if s.slice is not None)

    @property
    def zeros_bytes(self) -> int:
        """Bytes of the zeros `.grad` points at: the largest local shard per dtype in a mini-batch, else 0."""
        return sum(block.numel() * block.element_size() for block in self._zeros)

    @torch.no_grad()
    def begin(self, divide_factor: float) -> None:
        """Before the shards are published (peers add only after that): the sum starts from the gradients
        carried in, or from zero; every `.grad` becomes zeros for FSDP to add to."""
        self._had = [s.param.grad is not None for s in self.slots]
        if self.carries and any(self._had):
            for i, s in enumerate(self.slots):
                padded = self.acc[s.start : s.start + s.padded_numel]
                grad = s.param.grad
                if grad is None:
                    padded.zero_()
                    continue
                if not s.is_view(grad):  # assigned by the caller, a backward outside a mini-batch, or a copy
                    local = grad.to_local()
                    padded.zero_()
                    padded[: local.numel()].copy_(local.reshape(-1))
                    if s.slice is None:
                        self._copies[i] = grad
                padded.mul_(divide_factor)
        else:
            self.acc.zero_()
        self.flags.zero_()
        largest: dict[tuple[torch.dtype, torch.device], int] = {}
        for s in self.slots:
            local = s.param.to_local()
            key = (local.dtype, local.device)
            largest[key] = max(largest.get(key, 0), local.numel())
        blocks = {key: torch.zeros(numel, dtype=key[0], device=key[1]) for key, numel in largest.items()}
        self._zeros = list(blocks.values())
        for s in self.slots:
            local = s.param.to_local()
            s.param.grad = _as_grad_of(s.param, blocks[local.dtype, local.device][: local.numel()].view(local.shape))

    def prepare_end(self) -> None:
        """Allocate the `.grad` copies that end() fills (before the outcome is decided: see the module)."""
        for i, s in enumerate(self.slots):
            if s.slice is None and self._copies[i] is None:
                self._copies[i] = _as_grad_of(s.param, torch.empty_like(s.param.to_local()))

    @torch.no_grad()
    def end(self, divide_factor: float, all_reduce: Callable[[torch.Tensor], None] | None) -> None:
        """After the last accumulate has landed: sum over replicas (HSDP), divide, and make every `.grad`
        that some rank produced (or that was carried in) the result; the others stay None."""
        if all_reduce is not None:
            all_reduce(self.region)
        used = self.flags.tolist()
        self.acc.div_(divide_factor)
        for i, s in enumerate(self.slots):
            if not (used[i] or self._had[i]):
                s.param.grad = None
            elif s.slice is not None:
                s.param.grad = _as_grad_of(s.param, s.slice)
            else:
                local = self._copies[i].to_local()
                local.copy_(self.acc[s.start : s.start + local.numel()].view(local.shape))
                s.param.grad = self._copies[i]
        self._copies = [None] * len(self.slots)
        self._zeros = []

    @torch.no_grad()
    def detach(self) -> None:
        """Between mini-batches, before the accumulator is freed: every `.grad` that is a view of it gets a
        copy of its own (the `.grad` stock FSDP2 holds), with the same values."""
        for s in self.slots:
            grad = s.param.grad
            if grad is not None and s.is_view(grad):
                s.param.grad = _as_grad_of(s.param, s.slice.clone())

    @torch.no_grad()
    def drop(self) -> None:
        """After a failed mini-batch, once no peer adds into the accumulator any more (the caller sets every
        `.grad` to None): the accumulator zero."""
        self.region.zero_()
        self._had = [False] * len(self.slots)
        self._copies = [None] * len(self.slots)
        self._zeros = []
