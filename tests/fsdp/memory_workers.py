"""Per-rank bodies of the tests of ODC's memory: what it holds, counted by `memory_bytes()` and seen by the
system, and its release and rebuild between phases."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import ODCConfig, apply_odc
from odc_plugin.models import token_mean_loss

from .workers import TRANSPORT, count_targets, full_grads, minibatch_backward, on_device, sharded_model

# The transport's own regions (odc_plugin/comm/shm.py): a doorbell, an arrival word, the failure notices; what
# a released model still maps
CONTROL_REGIONS = frozenset({"odc.doorbell", "odc.barrier", "odc.failure"})
# The name every rank's file of an shm region has (odc_plugin/comm/shm.py):
# /dev/shm/odc-<token>-<region>-r<rank>-p<pid of its creator>
_SHM_FILE = re.compile(r"/dev/shm/odc-(?P<token>[0-9a-f]{12})-(?P<region>.+)-r(?P<owner>\d+)-p\d+(?: \(deleted\))?$")


@dataclass(frozen=True)
class ShmMapping:
    """One shm region file of ODC's that a process maps, as /proc/PID/maps shows it."""

    token: str  # the transport's
    region: str
    owner: int  # the rank whose slice it is
    nbytes: int  # the file's size (stat of /proc/PID/map_files); the mapping spans it in whole pages


def shm_mappings(pid: int | str = "self") -> list[ShmMapping]:
    """Every ODC shm file process `pid` maps, read from outside it (its /proc/PID/maps)."""
    found = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            match = _SHM_FILE.match(fields[5].strip()) if len(fields) == 6 else None
            if match:
                size = os.stat(f"/proc/{pid}/map_files/{fields[0]}").st_size
                found.append(ShmMapping(match["token"], match["region"], int(match["owner"]), size))
    return found


def _own(token: str, rank: int) -> dict[str, int]:
    """Bytes of this rank's own file of each region of transport `token`, as this process maps them."""
    return {m.region: m.nbytes for m in shm_mappings() if m.token == token and m.owner == rank}


def _token(transport) -> str:
    return os.path.basename(transport.path_prefix).removeprefix("odc-")


def _local_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def lifecycle(rank, world_size, seqs, plans, device):
    """A trained model through one backward mini-batch of plans[0], release() (its `.grad` kept, not zeroed),
    build() and a mini-batch of plans[1] that adds to that `.grad`, with the misuse a released model or an
    open mini-batch refuses; then a forward-only model built, used and released. What memory_bytes() said
    and what the system saw at each point: the files this process maps on CPU; on a GPU what building and
    releasing changed torch's allocated bytes by, and the bytes of peers' regions mapped. Before the rebuild
    on a GPU, expandable segments are turned on, as verl does after a weight sync."""
    cuda = device == "cuda"
    model = sharded_model(rank, world_size, device=device)
    seqs = on_device(seqs, device)
    global_tokens = count_targets(seqs)
    transport = make_transport(TRANSPORT[device])
    odc = apply_odc(model, transport, ODCConfig(barrier_timeout_s=60))
    out = {"built": odc.memory_bytes(), "shard_max": max(p.to_local().numel() for p in model.parameters())}
    out["ones"] = odc._ones.numel() * odc._ones.element_size()
    if cuda:
        out["mapped_built"] = transport.mapped_bytes()
    else:
        out["built_files"] = _own(_token(transport), rank)

    def inside():
        out["in_minibatch"] = odc.memory_bytes()

    minibatch_backward(model, odc, rank, world_size, seqs, plans[0], global_tokens, inside)
    out["after_end"] = odc.memory_bytes()
    grads = _local_grads(model)
    odc.release()
    out["released"] = odc.memory_bytes()
    out["grads_kept"] = all(torch.equal(p.grad.to_local(), grads[n]) for n, p in model.named_parameters() if n in grads)
    if cuda:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    else:
        out["released_files"] = [m for m in shm_mappings() if m.token == _token(transport)]
    try:
        odc.begin()
    except RuntimeError as e:
        out["begin_refused"] = (str(e), odc.in_minibatch)
    allocated = _allocated(cuda)
    odc.build()
    out["build_allocated"] = _allocated(cuda) - allocated

    def release_inside():
        try:
            odc.release()
        except RuntimeError as e:
            out["release_refused"] = (str(e), odc.released)

    minibatch_backward(model, odc, rank, world_size, seqs, plans[1], global_tokens, release_inside)
    out["grads"] = full_grads(model)
    model.zero_grad(set_to_none=True)
    allocated = _allocated(cuda)
    odc.release()
    out["release_freed"] = allocated - _allocated(cuda)
    out["rebuilt_released"] = odc.memory_bytes()
    if cuda:
        out["mapped_released"] = transport.mapped_bytes()

    reference = sharded_model(rank, world_size, device=device)
    forward_only = apply_odc(reference, make_transport(TRANSPORT[device]), ODCConfig(trains=False))
    out["forward_only"] = forward_only.memory_bytes()
    if not cuda:
        out["forward_only_files"] = _own(_token(forward_only.transport), rank)
    with torch.no_grad(), forward_only.minibatch(backward=False):
        token_mean_loss(reference, [seqs[i] for i in plans[0][rank][0]], global_tokens, world_size)
    forward_only.release()
    out["forward_only_released"] = forward_only.memory_bytes()
    if not cuda:
        out["forward_only_released_files"] = [m for m in shm_mappings() if m.token == _token(forward_only.transport)]
    return out


def _allocated(cuda: bool) -> int:
    if not cuda:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def forward_only_passes_of_a_trained_model(rank, world_size, seqs):
    """A trained model under bf16 mixed precision, its regions released before each pass and built at its
    start as verl's engine does between phases: a forward-only pass built with build(backward=False), a
    pass that trains, and a forward-only pass built with build() (what every forward-only pass held before
    the engine built with backward=False). memory_bytes() in each pass."""
    model = sharded_model(rank, world_size, mixed_precision=True)
    odc = apply_odc(model, make_transport("shm"))
    out = {}
    for label, builds_accumulator, backward in (
        ("forward-only", False, False),
        ("trained", True, True),
        ("forward-only, accumulator built", True, False),
    ):
        odc.release()
        model.zero_grad(set_to_none=True)  # as the optimizer step before a phase leaves `.grad`
        odc.build(backward=builds_accumulator)
        with odc.minibatch(backward=backward), torch.set_grad_enabled(backward):
            loss = token_mean_loss(model, seqs, count_targets(seqs), world_size)
            if backward:
                loss.backward()
        out[label] = odc.minibatch_memory
    odc.close()
    return out
