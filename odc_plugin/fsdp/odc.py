"""ODC on FSDP2: on-demand gathers and scatter-accumulates in place of FSDP's collectives.

`apply_odc(model, transport)` takes a model already wrapped with `fully_shard` (blocks and root) and
turns every all-gather into gets from the owners' published shards and every reduce-scatter into
accumulates into the owners' fp32 accumulators. A mini-batch is bracketed by `begin()` / `end()`:

- begin: this rank publishes its parameter shards (in the all-gather dtype) and raises its "published"
  flag. Peers wait for that flag, point to point, the first time they touch this rank in the mini-batch.
- end: one barrier (every accumulate has landed), then this rank's accumulator is its sharded `.grad`
  (gradients.py), so optimizer step and grad clipping run unchanged.

Between the two no collective runs, so ranks may run any number of micro-batches, zero included, and any
subset of the model's modules. Alongside each gradient a rank marks, in every owner's "used" flags, which
parameters it sent: a parameter no rank produced a gradient for keeps `.grad` None on every rank, as in
stock FSDP2 (AdamW then leaves it alone), while one some ranks used gets the exact sum. Both begin and
end reshard every module: ranks that ran different numbers of forwards (forward-only mini-batches
included) leave in one FSDP state, so plain evaluation forwards between mini-batches stay collective.

Over a 2-D (replicate x shard) mesh, FSDP2's HSDP, gets and accumulates stay inside the shard group
(the transport spans it: one node) and FSDP's per-module all-reduce across replicas is switched off. At
the end of every mini-batch every data-parallel rank first meets through the c10d store (so a dead rank
is named after the timeout, not waited on in a collective, and a failure on one node fails every node),
then its shard group meets at the transport's barrier, and then, after a backward mini-batch, each rank's
accumulator, with its used flags, is all-reduced across its replica group in one bucket. That is the
mini-batch's only collective; the result is the mean over all data-parallel ranks, as in stock HSDP, and
ranks of different replicas never wait for each other inside the mini-batch.

A mini-batch that fails on one rank fails on every rank (`abort`; docs/design.md, "A failed
mini-batch"): the failing rank announces it through the transport (and the store, under HSDP), every
peer's next wait raises ODCPeerFailedError naming it, the ranks meet once more so that no accumulate of
the failed mini-batch is still in flight, and each returns to idle, ready to begin() the next mini-batch.

Memory. The regions (published shards and their flag, the accumulator and its used flags) are allocated
by apply_odc and can be released between mini-batches and built again (`release()` / `build()`, both
collective): a training framework that hands the device to something else between phases (verl's
rollout) releases them, and ODC then holds only its transport's control words. Their content is not
kept: the published copy is republished at every begin(), and a `.grad` the accumulator held keeps its
values in a tensor of its own. `memory_bytes()` counts every byte ODC holds, in every state.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import time
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm import ODCError, ODCPeerFailedError, ODCTimeoutError, Transport
from ..comm.calibrate import Bucket, TransportCalibration, calibrate
from ..comm.failure import FailureNotice, first_failure
from ..comm.store_barrier import StoreBarrier
from . import _fsdp_internals as fsdp_internals
from .collectives import GroupLayout, OnDemandAllGather, ScatterAccumulate
from .config import MiniBatchStats, ODCConfig, ODCMemory
from .gradients import GradientStorage
from .mesh import data_parallel_mesh

# apply_odc is collective, so every rank creates its OnDemandComms in the same order: the count names
# each one's store barrier alike on all of its ranks.
_INSTANCES = itertools.count()


class OnDemandComm:
    """ODC state of one FSDP2 model: its regions, its hooks and the mini-batch protocol."""

    def __init__(self, model: nn.Module, transport: Transport, config: ODCConfig | None = None):
        """Set ODC up on a fully_shard-ed model; long because set-up is one ordered sequence (checks, mesh, regions,
        layouts, hooks) whose steps share their state.
        """
        if not isinstance(transport, Transport):
            raise TypeError(f"apply_odc needs a Transport (make_transport(kind, ...)), got {type(transport).__name__}")
        if config is not None and not isinstance(config, ODCConfig):
            raise TypeError(f"apply_odc's config must be an ODCConfig, got {type(config).__name__}")
        self.model = model
        self.transport = transport
        self.config = config or ODCConfig()
        self.rank, self.world_size = transport.rank, transport.world_size
        self.epoch = 0
        self.in_minibatch = False
        self.last_stats = MiniBatchStats()
        self._backward = False
        self._broken: ODCError | None = None  # why no further mini-batch can run (a peer gone, a lost meeting)
        self._closed = False
        self._ready_peers: set[int] = set()
        self._begin_time = 0.0
        self.build_s = 0.0  # seconds spent in build() and release() so far
        self.minibatch_memory: ODCMemory | None = None  # memory_bytes() in the last mini-batch
        # FSDP reduce-scatter inputs whose accumulates are issued, each with an event recorded after them
        # (GPU only): held until the compute stream waits for that event (ScatterAccumulate.allocate).
        self._sent: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._waits_at_backward_end = False  # whether the running backward ends with _end_of_backward

        self._modules_and_groups = modules_and_groups = fsdp_internals.fsdp_modules_and_groups(model)
        # fixed once fully_shard has run; memory_bytes(), called every mini-batch, reports it
        self._shard_numel = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))
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
        self.layouts: list[GroupLayout] = []
        self._gather_dtype = torch.uint8
        param_bytes = grad_numel = num_slots = 0
        for _, groups in modules_and_groups:
            if self.world_size > 1 and len(groups) > 1:
                raise ValueError(
                    "ODC needs one parameter group per fully_shard module; per-parameter "
                    "meshes (shard_placement_fn) are not supported"
                )
            for group in groups:
                shard = fsdp_internals.all_gather_input(group)
                nbytes = shard.numel() * shard.element_size()
                slots = fsdp_internals.grad_slots(group)
                self.layouts.append(GroupLayout(group, param_bytes, nbytes, grad_numel, num_slots, slots))
                # what gathers move (bytes where a group mixes dtypes): calibrate()'s gathers
                self._gather_dtype = shard.dtype if shard.dtype != torch.uint8 else self._gather_dtype
                param_bytes += nbytes
                grad_numel += sum(s.padded_numel for s in slots)
                num_slots += len(slots)
        self._param_bytes, self.grad_numel, self._num_slots = param_bytes, grad_numel, num_slots
        self.params = self.grads = self.published = None  # the regions (build)
        self._gradients: GradientStorage | None = None
        self._ones: torch.Tensor | None = None  # added into the used flags
        self._scatters: list[ScatterAccumulate] = []  # with the hooks, below; a failed build() reads it
        self.build()
        if self.grads is not None:
            device = self.grads.local.device
            elsewhere = {s.param.to_local().device for layout in self.layouts for s in layout.slots} - {device}
            if elsewhere:
                self.release()  # a refused apply_odc leaves nothing allocated on the transport
                raise ValueError(
                    f"offload_policy (FSDP2's CPU offload) of a trained model is not supported with ODC: its sharded "
                    f"parameters are on {sorted(map(str, elsewhere))}, ODC's gradient accumulator on {device}; turn "
                    f"offload_policy off, or set the model up forward-only (ODCConfig(trains=False))"
                )

        # With one rank FSDP never calls its comm hooks, and its own gradients are already final.
        if self.world_size > 1:
            layout_of = {id(layout.group): layout for layout in self.layouts}
            for module, groups in modules_and_groups:
                if not groups:
                    continue  # an FSDP module whose parameters all belong to its children
                layout = layout_of[id(groups[0])]
                scatter = ScatterAccumulate(self, layout)
                self._scatters.append(scatter)
                module.set_custom_all_gather(OnDemandAllGather(self, layout))
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

    @property
    def released(self) -> bool:
        """Whether the regions are released (`release()`): begin() then needs a `build()` first."""
        return self.params is None

    @property
    def _needs_accumulator(self) -> bool:
        # With one rank FSDP never calls its comm hooks and builds `.grad` itself; a forward-only model, or one
        # whose parameters are all frozen, has none.
        return self.config.trains and self.world_size > 1 and self._num_slots > 0

    def build(self, backward: bool = True) -> None:
        """Collective: allocate the model's regions, at apply_odc and again after `release()`; what exists
        already stays. `backward=False` for a phase's forward-only passes: the accumulator waits for a pass
        that trains. Every rank calls it at the same point of its collectives (e.g. when a pass starts).

        A rank whose allocation raises fails the build on every rank at once, as a failed mini-batch
        (`abort`): every peer raises ODCPeerFailedError naming it, each rank's regions are released, and a
        next build() can succeed."""
        self._check_usable()
        accumulator = backward and self._needs_accumulator and self.grads is None
        if not (self.released or accumulator):
            return
        start = time.perf_counter()
        try:
            self._allocate(accumulator)
        except BaseException as error:
            failure = self.abort(error)
            # After the recovery meeting every rank holds the same regions (an alloc that failed anywhere
            # kept nothing anywhere), so collective frees match; a group past a timeout meets no more.
            self._free_regions(collective=self._broken is None)
            raise failure  # noqa: B904  (abort returns `error` itself, or the peer's failure it caused)
        self.build_s += time.perf_counter() - start

    def _allocate(self, accumulator: bool) -> None:
        """The regions not built yet; nothing after the last alloc may fail on one rank alone (its peers
        would have left build())."""
        transport, timeout_s = self.transport, self.config.barrier_timeout_s
        if self.params is None:
            self.params = transport.alloc("odc.params", self._param_bytes, torch.uint8, timeout_s)
            self.published = transport.alloc("odc.published", 1, torch.int64, timeout_s)
        if accumulator:
            # One region, so that HSDP sums the accumulators and the used flags across replicas in one bucket.
            most = max((len(layout.slots) for layout in self.layouts), default=0)
            grads = transport.alloc("odc.grads", self.grad_numel + self._num_slots, torch.float32, timeout_s)
            self.grads = grads
            carries = self.mesh.replicate_group is None or dist.get_rank(self.mesh.replicate_group) == 0
            slots = [(slot, layout.grad_offset + slot.offset) for layout in self.layouts for slot in layout.slots]
            self._gradients = GradientStorage(grads.local, slots, carries)
            self._ones = torch.ones(most, device=grads.local.device)

    def release(self) -> None:
        """Collective, between mini-batches: free the model's regions on every rank (the published shards and
        their flag, the accumulator and its used flags), so that ODC holds only its transport's control words
        until `build()`. A `.grad` that is the accumulator's (an fp32 parameter's after a backward mini-batch,
        until zero_grad) first gets a copy of its own, as FSDP2 holds it. A no-op once released; inside a
        mini-batch it raises and changes nothing."""
        self._check_usable()
        if self.in_minibatch:
            raise RuntimeError("ODC release() inside a mini-batch; end() it first (the mini-batch goes on)")
        if self.released:
            return
        start = time.perf_counter()
        self.transport.synchronize()
        if self._gradients is not None:
            self._gradients.detach()
        self._free_regions()
        self.build_s += time.perf_counter() - start

    def _free_regions(self, collective: bool = True) -> None:
        names = [region.name for region in (self.published, self.grads, self.params) if region is not None]
        # Every view of a region goes before the region itself (Transport.free).
        self.params = self.grads = self.published = None
        self._gradients, self._ones = None, None
        for name in names if collective else ():
            self.transport.free(name)

    def calibrate(
        self, methods: Sequence[str] | None = None, slots_budget_bytes: int | None = None, repeats: int = 2
    ) -> TransportCalibration:
        """Collective, while released: time the transport against the shard group's all-gather and reduce-
        scatter at this model's FSDP groups (one rank's shard of each: what it gathers, and what it adds
        into each owner in a backward), and set the fastest of `methods` (default: every one the transport
        offers) for the accumulator built next (odc_plugin/comm/calibrate.py)."""
        self._check_usable()
        if not self.released:
            raise RuntimeError("calibrate() measures with regions of its own: release() the model's first")
        sizes: Counter[int] = Counter()
        for layout in self.layouts:
            numel = sum(s.padded_numel for s in layout.slots) or layout.param_nbytes // self._gather_dtype.itemsize
            sizes[max(numel, 1)] += 1
        return calibrate(
            self.transport,
            self.mesh.shard_group,
            [Bucket(numel, count) for numel, count in sorted(sizes.items())],
            gather_dtype=self._gather_dtype,
            reduce_dtype=next(
                (d for d in map(fsdp_internals.reduce_dtype, (x.group for x in self.layouts)) if d), torch.float32
            ),
            methods=methods,
            slots_budget_bytes=slots_budget_bytes,
            repeats=repeats,
            timeout_s=self.config.barrier_timeout_s,
        )

    def memory_bytes(self) -> ODCMemory:
        """What this rank's ODC holds for the model now, as its transport allocated it, against stock FSDP2."""
        transport, gradients = self.transport, self._gradients
        return ODCMemory(
            published=sum(transport.region_bytes(r) for r in (self.params, self.published) if r is not None),
            accumulator=0 if self.grads is None else transport.region_bytes(self.grads),
            scratch=(0 if gradients is None else gradients.zeros_bytes)
            + (0 if self._ones is None else self._ones.numel() * self._ones.element_size()),
            staging=transport.staging_bytes(),
            control=transport.control_bytes(),
            grad_storage=0 if gradients is None else gradients.grad_storage_bytes,
            shard_numel=self._shard_numel,
        )

    def _wait_for_sent(self, stream) -> None:
        """Make `stream` (the compute stream) wait until the accumulates issued so far have read their
        reduce-scatter inputs, then let go of those: as FSDP2 bounds the reduce-scatter inputs in flight."""
        for _, event in self._sent:
            stream.wait_event(event)
        self._sent.clear()

    def _end_of_backward(self) -> None:
        """The last reduce-scatter of a backward has no next one to wait at: the compute stream waits for its
        accumulates when the backward ends, as FSDP2's own final callback waits for its reduce-scatter, so
        that the input (the root's: embeddings and head, the largest) is not held through the next forward."""
        self._waits_at_backward_end = False
        if self._sent:
            self._wait_for_sent(torch.cuda.current_stream(self._sent[-1][0].device))

    def begin(self, backward: bool = True) -> None:
        """Start a mini-batch: publish this rank's shards. `backward=False` for forward-only passes. Misuse
        (a mini-batch already open, a backward one on a forward-only model, a closed model) raises and changes
        nothing; any other exception means the mini-batch has failed on every rank (see `abort`)."""
        # Misuse is refused before anything changes: a mini-batch in flight goes on.
        self._check_usable()
        if self.in_minibatch:
            raise RuntimeError("ODC begin() called twice without end(); the mini-batch in flight goes on")
        if backward and not self.config.trains:
            raise ValueError(
                "this model was set up forward-only (ODCConfig(trains=False)): it has no gradient "
                "accumulator; begin(backward=False)"
            )
        if self.released:
            raise RuntimeError("ODC's regions are released (release()); call build() on every rank before begin()")
        if backward and self._needs_accumulator and self.grads is None:
            raise RuntimeError(
                "ODC's gradient accumulator is not built (build(backward=False)); call build() on every rank "
                "before a backward begin()"
            )
        with self.guard():
            self.in_minibatch, self._backward = True, backward
            self._begin_time = time.perf_counter()
            self.epoch += 1
            self._ready_peers = {self.rank}
            # An evaluation forward since the last mini-batch may have left modules unsharded; the shards
            # published below are the sharded parameters.
            fsdp_internals.reset_to_idle(self._modules_and_groups)
            if backward and self._gradients is not None:
                self._gradients.begin(self.divide_factor)
            self.minibatch_memory = self.memory_bytes()
            with torch.no_grad():
                for layout in self.layouts:
                    shard = fsdp_internals.all_gather_input(layout.group).view(torch.uint8)
                    self.params.local[layout.param_offset : layout.param_offset + layout.param_nbytes].copy_(shard)
            self.transport.signal(self.published, 0, self.epoch)

    def end(self) -> MiniBatchStats:
        """Finish the mini-batch: meet every rank once, then take this rank's gradient shard. If it raises,
        the mini-batch has failed on every rank (see `abort`)."""
        self._check_usable()
        if not self.in_minibatch:
            raise RuntimeError("ODC end() called without begin()")
        backward = self._backward and self._gradients is not None
        arrive = time.perf_counter()
        with self.guard():
            for scatter in self._scatters:
                scatter.check_sent()
            if backward:
                self._gradients.prepare_end()
            self.transport.synchronize()
            # The outcome is decided here, alike on every rank: a barrier passes only once every rank has
            # arrived, and no rank fails after arriving. What follows cannot fail on one rank alone.
            if self._replicas is not None:
                self._replicas.wait(self.config.barrier_timeout_s)
            self.transport.barrier(self.config.barrier_timeout_s)
        done = time.perf_counter()
        self._sent.clear()  # the barrier waited for the device: every accumulate has read its input
        self.in_minibatch = False
        fsdp_internals.reset_to_idle(self._modules_and_groups)
        if backward:
            group = self.mesh.replicate_group
            self._gradients.end(self.divide_factor, functools.partial(dist.all_reduce, group=group) if group else None)
        self.last_stats = MiniBatchStats(compute_s=arrive - self._begin_time, wait_s=done - arrive)
        return self.last_stats

    @contextlib.contextmanager
    def minibatch(self, backward: bool = True):
        """begin(), the body, end(); an exception in any of them fails the mini-batch on every rank, and what
        this rank raises is what `abort` returns."""
        self.begin(backward)
        try:
            yield self
        except BaseException as error:
            raise self.abort(error)  # noqa: B904  (abort returns `error` itself, or the peer's failure it caused)
        self.end()

    @contextlib.contextmanager
    def guard(self):
        """Work of this rank for a mini-batch, inside it or before its begin() (preparing its data): an
        exception in it fails, on every rank, the open mini-batch or else the one the peers begin next
        (`abort`); what propagates is what abort returns. begin() and end() run under it."""
        try:
            yield
        except BaseException as error:
            raise self.abort(error)  # noqa: B904  (see minibatch)

    def abort(self, error: BaseException) -> BaseException:
        """Fail, on every rank, the mini-batch that `error` ended on this rank; outside a mini-batch, the
        next one (this rank's preparation of it raised before begin()). Returns what to raise: `error`
        itself if this rank failed, or ODCPeerFailedError naming the first rank that failed if `error` is
        this rank learning of it (begin(), end() and minibatch() call this themselves).

        A rank that failed announces it on the transport (and, under HSDP, in the store): every peer's
        next wait raises ODCPeerFailedError instead of waiting out the barrier timeout. Then every rank
        meets once more (the recovery meeting): once all are there, none has an accumulate of the failed
        mini-batch in flight, so each zeroes its accumulator (every sharded `.grad` becomes None) and returns
        its FSDP state to idle, and the next begin() on every rank starts a mini-batch as if the failed one
        had never run. A timeout (a peer that is gone) skips that meeting, and ODC cannot run again.
        """
        if self._broken is not None:
            return error
        opened, self.in_minibatch = self.in_minibatch, False
        if not opened:
            self.epoch += 1  # the mini-batch this rank fails before beginning it, which its peers begin
        if not isinstance(error, (ODCPeerFailedError, ODCTimeoutError)):
            self._announce(error)
        for scatter in self._scatters:
            scatter.discard()
        self._sent.clear()
        self._waits_at_backward_end = False  # a backward that raised runs no final callback
        fsdp_internals.reset_after_failure(self._modules_and_groups)
        if isinstance(error, ODCTimeoutError):
            self._broken = ODCTimeoutError(f"mini-batch {self.epoch} timed out ({error})")
            return error
        try:
            notices = self._recover()
        except BaseException as failure:
            why = f"the ranks did not all meet after mini-batch {self.epoch} failed ({failure})"
            self._broken = (type(failure) if isinstance(failure, ODCError) else ODCError)(why)
            if not isinstance(failure, Exception):
                raise
            _add_note(error, f"ODC: {why}; ODC cannot run another mini-batch")
            return error
        if self._gradients is not None:
            self._gradients.drop()
        for param in self.model.parameters():
            param.grad = None  # with one rank, FSDP's own, half summed
        if not isinstance(error, ODCPeerFailedError) or not notices:
            return error
        first = first_failure(notices)
        return ODCPeerFailedError(
            f"rank {dist.get_rank()}: rank {first.rank} failed in its mini-batch: {first.message}"
        )

    def _announce(self, error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}"
        try:
            self.transport.announce_failure(message)
            if self._replicas is not None:
                self._replicas.announce_failure(message)
        except Exception as failure:  # e.g. a GPU whose context the error itself left unusable
            _add_note(
                error, f"ODC could not announce this failure ({failure}); peers fail after barrier_timeout_s instead"
            )
            return
        # Which rank failed, under the exception wherever it is printed (a driver may show any rank's error).
        _add_note(error, f"ODC: rank {dist.get_rank()} failed mini-batch {self.epoch}, which failed on every rank")

    def _recover(self) -> list[FailureNotice]:
        """The recovery meeting: the shard group at its transport (no accumulate of the failed mini-batch
        in flight), then, under HSDP, every data-parallel rank in the store. The failures announced, by
        global rank: complete once every rank has come."""
        timeout_s = self.config.barrier_timeout_s
        shard = self.mesh.shard_group
        notices = [
            FailureNotice(dist.get_global_rank(shard, n.rank), n.time_ns, n.message)
            for n in self.transport.recover(timeout_s)
        ]
        if self._replicas is not None:
            notices = self._replicas.recover(timeout_s)
        return notices

    def _check_usable(self) -> None:
        """Refuse a call once the group is unusable, with the type of what made it so (an ODCError)."""
        if self._closed:
            raise RuntimeError("ODC was closed (close()); apply_odc() the model again to train it with ODC")
        if self._broken is not None:
            raise type(self._broken)(f"ODC cannot run another mini-batch: {self._broken}")

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
        """Release the transport; later calls are refused. Safe to call twice."""
        self._closed = True
        self.transport.close()


def apply_odc(model: nn.Module, transport: Transport, config: ODCConfig | None = None) -> OnDemandComm:
    """Switch a `fully_shard`-ed model to on-demand communication (collective: all ranks call it).

    `transport` spans the model's shard group: all ranks for a 1-D mesh, one shard group (one node) of
    a 2-D HSDP mesh (`make_transport(kind, group=shard_group(model))`). A forward-only model takes
    `ODCConfig(trains=False)`.
    """
    return OnDemandComm(model, transport, config)


def _add_note(error: BaseException, note: str) -> None:
    """Python >= 3.11 shows notes under the exception's message; 3.10 has none to add to."""
    if hasattr(error, "add_note"):
        error.add_note(note)
