"""ODC on FSDP2: on-demand gathers and scatter-accumulates in place of FSDP's collectives.

`apply_odc(model, transport)` takes a model already wrapped with `fully_shard` (blocks and root) and
turns every all-gather into gets from the owners' published shards and every reduce-scatter into
accumulates into the owners' fp32 accumulators. A mini-batch is bracketed by `begin()` / `end()`:

- begin: this rank publishes its parameter shards (in the all-gather dtype) and raises its "published"
  flag. Peers wait for that flag, point to point, the first time they touch this rank in the mini-batch.
- end: one barrier (every accumulate has landed), then this rank's accumulator becomes its sharded
  `.grad`, so optimizer step and grad clipping run unchanged.

Between the two no collective runs, so ranks may run any number of micro-batches, zero included, and any
subset of the model's modules. Alongside each gradient a rank marks, in every owner's "used" flags, which
parameters it sent: a parameter no rank produced a gradient for keeps `.grad` None on every rank, as in
stock FSDP2 (AdamW then leaves it alone), while one some ranks used gets the exact sum. Both begin and
end reshard every module: ranks that ran different numbers of forwards (forward-only mini-batches
included) leave in one FSDP state, so plain evaluation forwards between mini-batches stay collective.

Over a 2-D (replicate x shard) mesh, FSDP2's HSDP, gets and accumulates stay inside the shard group
(the transport spans it: one node) and FSDP's per-module all-reduce across replicas is switched off. At
the end of a backward mini-batch every data-parallel rank first meets through the c10d store (so a dead
rank is named after the timeout, not waited on in a collective), then its shard group meets at the
transport's barrier, and then each rank's accumulator, with its used flags, is all-reduced across its
replica group in one bucket. That is the mini-batch's only collective; the result is the mean over all
data-parallel ranks, as in stock HSDP, and ranks of different replicas never wait for each other inside
the mini-batch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm import Transport
from ..comm.store_barrier import StoreBarrier
from . import _fsdp_internals as fsdp_internals
from ._fsdp_internals import AllGather, ReduceScatter
from .mesh import data_parallel_mesh

# apply_odc is collective, so every rank creates its OnDemandComms in the same order: the count names
# each one's store barrier alike on all of its ranks.
_INSTANCES = itertools.count()


@dataclass(kw_only=True)
class ODCConfig:
    """How `apply_odc` runs a model's mini-batches (keyword-only)."""

    barrier_timeout_s: float = 600.0
    """How long a rank waits for a peer (its published shards, or the end-of-mini-batch barrier) before it
    fails naming the ranks that did not get there; > 0."""

    gradient_divide_factor: float | None = None
    """What the summed gradients are divided by; None keeps FSDP2's default, the mean over ranks of each
    rank's summed micro-batch gradients."""

    lockstep: bool = False
    """A barrier before every gather and scatter inside the mini-batch: FSDP's per-layer synchronization on
    ODC's transport, the baseline that isolates what removing the barriers buys (benchmarks only; like
    FSDP it needs every rank to run the same micro-batches through the same modules)."""

    def __post_init__(self):
        if not self.barrier_timeout_s > 0:
            raise ValueError(f"barrier_timeout_s must be > 0, got {self.barrier_timeout_s}")
        if self.gradient_divide_factor is not None and not self.gradient_divide_factor > 0:
            raise ValueError(f"gradient_divide_factor must be > 0 or None, got {self.gradient_divide_factor}")


@dataclass
class MiniBatchStats:
    compute_s: float = 0.0  # begin -> arrival at the barrier
    wait_s: float = 0.0  # time in the barrier


@dataclass(frozen=True)
class _GroupLayout:
    """Where one FSDP parameter group lives in the symmetric regions."""

    group: object  # FSDPParamGroup
    param_offset: int  # bytes into the params region
    param_nbytes: int
    grad_offset: int  # elements into the grads region
    used_offset: int  # elements into the used flags, one per slot, which follow the accumulators
    slots: list[fsdp_internals.ParamSlot]


class OnDemandComm:
    """ODC state of one FSDP2 model: its regions, its hooks and the mini-batch protocol."""

    def __init__(self, model: nn.Module, transport: Transport, config: ODCConfig | None = None):
        """Set ODC up on a fully_shard-ed model; long because set-up is one ordered sequence (checks, mesh, regions,
        layouts, hooks) whose steps share their state.
        """
        self.model = model
        self.transport = transport
        self.config = config or ODCConfig()
        self.rank, self.world_size = transport.rank, transport.world_size
        self.epoch = 0
        self.in_minibatch = False
        self.last_stats = MiniBatchStats()
        self._backward = False
        self._ready_peers: set[int] = set()
        self._begin_time = 0.0

        self._modules_and_groups = modules_and_groups = fsdp_internals.fsdp_modules_and_groups(model)
        if fsdp_internals.reshards_to_a_smaller_group(modules_and_groups):
            # Backward would gather from the smaller group's post-forward shards, which no owner publishes.
            raise ValueError(
                "reshard_after_forward as an int is not supported with ODC (gets read the shards "
                "every rank publishes); pass fully_shard reshard_after_forward=True or False"
            )
        self.mesh = data_parallel_mesh(model)
        shard = self.mesh.shard_group
        if (self.world_size, self.rank) != (dist.get_world_size(shard), dist.get_rank(shard)):
            raise ValueError(
                f"the transport spans {self.world_size} ranks (this one is {self.rank}), but FSDP "
                f"shards over {dist.get_world_size(shard)} (this one is {dist.get_rank(shard)}); build "
                f"it with make_transport(kind, group=odc_plugin.fsdp.shard_group(model))"
            )
        self._replicas: StoreBarrier | None = None
        if self.mesh.replicate_group is not None:
            if self.world_size == 1:
                raise ValueError(
                    "ODC over HSDP needs shard groups of 2 or more ranks; with one rank per shard "
                    "group there is nothing to get or accumulate"
                )
            fsdp_internals.reduce_within_shard_group(modules_and_groups)
            ranks = self.mesh.ranks
            name = f"{next(_INSTANCES)}-{hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]}"
            self._replicas = StoreBarrier(ranks, dist.get_rank(), name)
        self.layouts: list[_GroupLayout] = []
        param_bytes = grad_numel = num_slots = 0
        for _, groups in modules_and_groups:
            for group in groups:
                shard = fsdp_internals.all_gather_input(group)
                nbytes = shard.numel() * shard.element_size()
                slots = fsdp_internals.grad_slots(group)
                self.layouts.append(_GroupLayout(group, param_bytes, nbytes, grad_numel, num_slots, slots))
                param_bytes += nbytes
                grad_numel += sum(s.padded_numel for s in slots)
                num_slots += len(slots)
        self.params = transport.alloc("odc.params", param_bytes, torch.uint8)
        # One region, so that HSDP sums the accumulators and the used flags across replicas in one bucket.
        self.grad_numel = grad_numel
        self.grads = transport.alloc("odc.grads", grad_numel + num_slots, torch.float32)
        self.published = transport.alloc("odc.published", 1, torch.int64)

        self._scatters: list[_ScatterAccumulate] = []
        # With one rank FSDP never calls its comm hooks, and its own gradients are already final.
        if self.world_size > 1:
            layout_of = {id(layout.group): layout for layout in self.layouts}
            for module, groups in modules_and_groups:
                if not groups:
                    continue  # an FSDP module whose parameters all belong to its children
                if len(groups) > 1:
                    raise ValueError(
                        "ODC needs one parameter group per fully_shard module; per-parameter "
                        "meshes (shard_placement_fn) are not supported"
                    )
                layout = layout_of[id(groups[0])]
                scatter = _ScatterAccumulate(self, layout)
                self._scatters.append(scatter)
                module.set_custom_all_gather(_OnDemandAllGather(self, layout))
                module.set_custom_reduce_scatter(scatter)
                # Plain sums reach the hook; ODC divides once, at the end of the mini-batch.
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
                # Right after its reduce-scatter, FSDP calls these hooks of the sharded parameters it
                # reduced, in order: that tells which slots the reduce-scatter input holds.
                for index, slot in enumerate(layout.slots):
                    slot.param.register_post_accumulate_grad_hook(functools.partial(scatter.reduced, index))

    @property
    def divide_factor(self) -> float:
        return self.config.gradient_divide_factor or float(self.world_size * self.mesh.num_replicas)

    def begin(self, backward: bool = True) -> None:
        """Start a mini-batch: publish this rank's shards. `backward=False` for forward-only passes."""
        if self.in_minibatch:
            raise RuntimeError("ODC begin() called twice without end()")
        self.in_minibatch, self._backward = True, backward
        self._begin_time = time.perf_counter()
        self.epoch += 1
        self._ready_peers = {self.rank}
        # An evaluation forward since the last mini-batch may have left modules unsharded; the shards
        # published below are the sharded parameters.
        fsdp_internals.reset_to_idle(self._modules_and_groups)
        with torch.no_grad():
            for layout in self.layouts:
                shard = fsdp_internals.all_gather_input(layout.group).view(torch.uint8)
                self.params.local[layout.param_offset : layout.param_offset + layout.param_nbytes].copy_(shard)
        self.transport.signal(self.published, 0, self.epoch)

    def end(self) -> MiniBatchStats:
        """Finish the mini-batch: meet every rank once, then take this rank's gradient shard."""
        if not self.in_minibatch:
            raise RuntimeError("ODC end() called without begin()")
        arrive = time.perf_counter()
        try:
            for scatter in self._scatters:
                scatter.check_sent()
            self.transport.synchronize()
            if self._replicas is not None and self._backward:
                self._replicas.wait(self.config.barrier_timeout_s)
            self.transport.barrier(self.config.barrier_timeout_s)
        finally:
            self.in_minibatch = False
        done = time.perf_counter()
        fsdp_internals.reset_to_idle(self._modules_and_groups)
        if self._backward and self.world_size > 1:
            self._take_gradients()
        self.last_stats = MiniBatchStats(compute_s=arrive - self._begin_time, wait_s=done - arrive)
        return self.last_stats

    @contextlib.contextmanager
    def minibatch(self, backward: bool = True):
        self.begin(backward)
        try:
            yield self
        except BaseException as error:
            self.abort(error)
            raise
        self.end()

    def abort(self, error: BaseException) -> None:
        """End a mini-batch that raised `error` on this rank: tell the peers (each fails at once, naming
        this rank and the error, instead of waiting out the barrier timeout) and return to idle, so that a
        caller that handles the error may begin() again. The gradients of the failed mini-batch are lost
        on every rank; a retry has to begin a new mini-batch on all of them."""
        if not self.in_minibatch:
            return
        self.in_minibatch = False
        self.transport.fail(f"{type(error).__name__}: {error}")
        for scatter in self._scatters:
            scatter.discard()
        fsdp_internals.reset_to_idle(self._modules_and_groups)
        self.grads.local.zero_()

    @torch.no_grad()
    def _take_gradients(self) -> None:
        acc = self.grads.local
        if self.mesh.replicate_group is not None:
            dist.all_reduce(acc, group=self.mesh.replicate_group)
        used = acc[self.grad_numel :].tolist()
        for layout in self.layouts:
            for index, slot in enumerate(layout.slots):
                if not used[layout.used_offset + index]:
                    continue  # no rank produced a gradient: `.grad` stays as it was, as in stock FSDP2
                param = slot.param
                local = param.to_local()
                start = layout.grad_offset + slot.offset
                grad = (acc[start : start + local.numel()].view(local.shape) / self.divide_factor).to(local.dtype)
                if param.grad is None:
                    param.grad = DTensor.from_local(
                        grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                    )
                else:
                    param.grad.to_local().add_(grad)
        acc.zero_()

    def wait_published(self, peer: int) -> None:
        """Block until `peer` has published this mini-batch's shards (once per peer per mini-batch)."""
        if peer not in self._ready_peers:
            self.transport.wait_at_least(
                self.published, peer, 0, self.epoch, self.config.barrier_timeout_s, f"mini-batch {self.epoch} shards"
            )
            self._ready_peers.add(peer)

    def peers(self):
        """Every other rank, starting after this one, so ranks do not all hit the same owner at once."""
        return [(self.rank + i) % self.world_size for i in range(1, self.world_size)]

    def close(self) -> None:
        self.transport.close()


class _BufferAlloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _OnDemandAllGather(_BufferAlloc, AllGather):
    """FSDP all-gather replaced by gets from each owner's published shard."""

    def __init__(self, odc: OnDemandComm, layout: _GroupLayout):
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


class _ScatterAccumulate(_BufferAlloc, ReduceScatter):
    """FSDP reduce-scatter replaced by accumulates into each owner's gradient accumulator.

    FSDP's input holds only the parameters this rank has a gradient for; which ones is known only as FSDP
    calls `reduced` for each of them, right after this hook. So the hook keeps the input, and the
    accumulates go out once those calls have covered all of it.
    """

    def __init__(self, odc: OnDemandComm, layout: _GroupLayout):
        self.odc, self.layout = odc, layout
        self._input: torch.Tensor | None = None
        self._reduced: list[int] = []  # slot indices, in FSDP's order
        self._covered = 0  # elements of one rank's chunk that those slots fill
        self._ones: torch.Tensor | None = None

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
        self._input = None
        if odc.config.lockstep:
            odc.transport.barrier(odc.config.barrier_timeout_s)
        if self._ones is None:
            self._ones = torch.ones(len(layout.slots), device=chunks.device)
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
                    odc.grads, peer, odc.grad_numel + layout.used_offset + first, self._ones[:count]
                )


def apply_odc(model: nn.Module, transport: Transport, config: ODCConfig | None = None) -> OnDemandComm:
    """Switch a `fully_shard`-ed model to on-demand communication (collective: all ranks call it).

    `transport` spans the model's shard group: all ranks for a 1-D mesh, one shard group (one node) of
    a 2-D HSDP mesh (`make_transport(kind, group=shard_group(model))`).
    """
    return OnDemandComm(model, transport, config)
