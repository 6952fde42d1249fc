"""Per-rank bodies of the tests of how long ODC keeps FSDP's reduce-scatter input."""

from __future__ import annotations

import torch

from odc_plugin.comm import DelegatingTransport, Transport, make_transport
from odc_plugin.fsdp import ODCConfig, apply_odc
from odc_plugin.models import token_mean_loss

from .workers import TRANSPORT, count_targets, full_grads, on_device, sharded_model


class WatchedTransport(DelegatingTransport):
    """A transport that, before each accumulate of gradients, can delay the stream it runs on (a GPU's
    reduce-scatter stream lagging behind compute) and records whether an ODC reduce-scatter hook still
    holds the buffer the accumulate reads."""

    def __init__(self, inner: Transport, delay_cycles: int = 0):
        super().__init__(inner)
        self.delay_cycles = delay_cycles
        self.odc = None  # set once apply_odc has returned
        self.held: list[bool] = []

    def accumulate(self, region, peer, offset, src):
        if self.odc is not None and offset < self.odc.grad_numel:  # gradients, not the used flags
            storage = src.untyped_storage().data_ptr()
            self.held.append(
                any(
                    s._input is not None and s._input.untyped_storage().data_ptr() == storage
                    for s in self.odc._scatters
                )
            )
            if self.delay_cycles and src.is_cuda:
                torch.cuda._sleep(self.delay_cycles)
        self.inner.accumulate(region, peer, offset, src)


class _LetGo(list):
    """In place of ODC's list of sent reduce-scatter inputs (OnDemandComm._sent): each is let go at once,
    so the compute stream never waits for its accumulates."""

    def append(self, sent) -> None:
        pass


def watched_grads(rank, world_size, seqs, plan, device, delay_cycles, stream_bookkeeping=True):
    """One ODC mini-batch of plan[rank] over a WatchedTransport; the gradients, whether every accumulate
    read a buffer the hook still held, and whether any hook holds one after end(). Without
    `stream_bookkeeping` (the negative control) ODC lets go of each reduce-scatter input as soon as its
    accumulates are issued, so the caching allocator may hand it out while they still read it."""
    model = sharded_model(rank, world_size, device=device)
    transport = WatchedTransport(make_transport(TRANSPORT[device]), delay_cycles)
    odc = apply_odc(model, transport, ODCConfig(barrier_timeout_s=60))
    transport.odc = odc
    if not stream_bookkeeping:
        odc._sent = _LetGo()
    seqs = on_device(seqs, device)
    global_tokens = count_targets(seqs)
    with odc.minibatch():
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
    return {
        "grads": full_grads(model),
        "accumulates": len(transport.held),
        "all_held": all(transport.held),
        "held_after_end": any(s._input is not None for s in odc._scatters),
    }
