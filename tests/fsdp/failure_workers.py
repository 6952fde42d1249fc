"""Per-rank bodies of the failure tests: a mini-batch fails on one rank, every rank goes on training.

The barrier timeout stays at its default (600 s) throughout: a rank that waited it out would blow the
tests' 5 s bounds by far.
"""

from __future__ import annotations

import glob
import os
import time

import torch

from odc_plugin.comm import make_transport
from odc_plugin.comm.base import SETUP_TIMEOUT_S, DelegatingTransport
from odc_plugin.fsdp import apply_odc, shard_group
from odc_plugin.models import token_mean_loss

from .hsdp_workers import full_params as hsdp_full_params
from .hsdp_workers import hsdp_model
from .workers import TRANSPORT, count_targets, full_params, on_device, sharded_model

INJECTED = "injected failure"
# Where the culprit's mini-batch fails: before begin() (its preparation raised), after its first
# micro-batch's backward, halfway through the backward of its first micro-batch (the last layer's
# gradients already sent), inside its last micro-batch's forward (the last layer gathered), in end().
WHERE = ("before_begin", "after_first_backward", "mid_backward", "last_forward", "end")


def _raise_once(where: str, rank: int):
    armed = [True]

    def fire(*_args, **_kwargs):
        if armed[0]:
            armed[0] = False
            raise RuntimeError(f"{INJECTED} ({where}) on rank {rank}")

    return fire


def failing_minibatch(model, odc, rank, world_size, seqs, plan, culprit, where) -> tuple[str, float]:
    """One mini-batch over plan[rank] in which rank `culprit` raises at `where`. Returns what this rank
    raised and how long after the mini-batch's start."""
    fire = _raise_once(where, rank) if rank == culprit else None
    layers, last = model.model.layers, [False]
    hooks = []
    if fire and where == "mid_backward":  # the first layer's backward: the last layer's gradient is sent
        hooks.append(layers[0].register_full_backward_pre_hook(fire))
    if fire and where == "last_forward":
        hooks.append(layers[-1].register_forward_pre_hook(lambda module, args: fire() if last[0] else None))
    synchronize = odc.transport.synchronize
    global_tokens = count_targets([seqs[i] for share in plan for mb in share for i in mb])
    start = time.monotonic()
    try:
        if fire and where == "before_begin":
            try:
                fire()  # preparing the mini-batch raised: its peers begin it, this rank fails it
            except RuntimeError as e:
                raise odc.abort(e)  # noqa: B904  (abort returns e itself on the failing rank)
        with odc.minibatch():
            for i, mb in enumerate(plan[rank]):
                last[0] = i == len(plan[rank]) - 1
                token_mean_loss(model, [seqs[j] for j in mb], global_tokens, world_size).backward()
                if fire and where == "after_first_backward" and i == 0:
                    fire()
            if fire and where == "end":
                # end()'s first call: where an asynchronous GPU error would surface
                def failing_synchronize():
                    odc.transport.synchronize = synchronize
                    fire()

                odc.transport.synchronize = failing_synchronize
        outcome = "finished"
    except Exception as e:  # noqa: BLE001  (what each rank raised is the result)
        outcome = f"{type(e).__name__}: {e}"
    finally:
        for hook in hooks:
            hook.remove()
    return outcome, time.monotonic() - start


def good_minibatch(model, odc, opt, rank, world_size, seqs, plan) -> None:
    """One mini-batch and an AdamW step with clipping, as tests/fsdp/workers.adamw_steps."""
    opt.zero_grad(set_to_none=True)
    global_tokens = count_targets(seqs)
    with odc.minibatch():
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def retry_after_failure(rank, world_size, failed, retried, culprit, where):
    """A mini-batch that fails (`failed`: sequences and plan), then the same ranks train one mini-batch
    (`retried`) and step. Returns what this rank raised, when, whether every `.grad` was None after the
    failure, and the trained parameters."""
    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"))
    outcome, elapsed = failing_minibatch(model, odc, rank, world_size, *failed, culprit, where)
    dropped = all(p.grad is None for p in model.parameters())
    good_minibatch(model, odc, _adamw(model), rank, world_size, *retried)
    params = full_params(model)
    odc.close()
    return {"outcome": outcome, "elapsed": elapsed, "grads_dropped": dropped, "params": params}


def _resources(prefix: str) -> dict:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps") as f:
        shm_maps = sum("/dev/shm/" in line for line in f)
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "shm_maps": shm_maps,
        "rss": rss,
        "shm_files": sorted(glob.glob(f"{prefix}*")),
    }


def alternating(rank, world_size, batches, failures):
    """For each (seqs, plan) of `batches`: a mini-batch that fails as `failures` says ((culprit, where),
    in turn), then that mini-batch trained and stepped. Returns the outcomes and times of the failed
    ones, this process's resources after the second and the last round, and the trained parameters."""
    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"))
    opt = _adamw(model)
    failed, resources = [], {}
    for k, ((seqs, plan), (culprit, where)) in enumerate(zip(batches, failures)):
        failed.append(failing_minibatch(model, odc, rank, world_size, seqs, plan, culprit, where))
        good_minibatch(model, odc, opt, rank, world_size, seqs, plan)
        if k in (1, len(batches) - 1):
            resources["second" if k == 1 else "last"] = _resources(odc.transport.path_prefix)
    params = full_params(model)
    odc.close()
    return {"failed": failed, "resources": resources, "params": params}


def hsdp_retry_after_failure(rank, world_size, failed, retried, culprit, where):
    """retry_after_failure on the 2 x 2 HSDP mesh, each node its own shared-memory transport."""
    model = hsdp_model()
    odc = apply_odc(model, make_transport("shm", group=shard_group(model)))
    outcome, elapsed = failing_minibatch(model, odc, rank, world_size, *failed, culprit, where)
    good_minibatch(model, odc, _adamw(model), rank, world_size, *retried)
    return {"outcome": outcome, "elapsed": elapsed, "params": hsdp_full_params(model)}


def _refusal(call) -> str:
    try:
        call()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "not refused"


def misuse_in_flight(rank, world_size, seqs, plan):
    """end() without begin(), then a mini-batch over plan[rank] in which rank 1, after its first micro-batch,
    calls begin() twice and begin() of a forward-only model: each refused, the mini-batch goes on. Also
    calls after close(). Returns the refusals and the gradients."""
    from odc_plugin.fsdp import ODCConfig

    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"))
    forward_only = apply_odc(sharded_model(rank, world_size), make_transport("shm"), ODCConfig(trains=False))
    refused = {"end_without_begin": _refusal(odc.end)}
    global_tokens = count_targets(seqs)
    odc.begin()
    for i, mb in enumerate(plan[rank]):
        token_mean_loss(model, [seqs[j] for j in mb], global_tokens, world_size).backward()
        if i == 0 and rank == 1:
            refused["begin_twice"] = _refusal(odc.begin)
            refused["backward_on_forward_only"] = _refusal(forward_only.begin)
    odc.end()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    forward_only.close()
    refused["begin_after_close"] = _refusal(lambda: forward_only.begin(backward=False))
    odc.close()
    return refused, grads


def next_call_after_timeout(rank, world_size, seqs, plan):
    """Rank 2 never begins the first mini-batch; the others time out waiting for its shards, then begin()
    again. Returns, on ranks 0 and 1, the names of the classes of both errors and the second's message."""
    from odc_plugin.comm import ODCTimeoutError
    from odc_plugin.fsdp import ODCConfig

    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"), ODCConfig(barrier_timeout_s=1.0))
    if rank == 2:
        time.sleep(3.0)  # past the others' timeout, then leaves without a word
        return None
    global_tokens = count_targets(seqs)
    try:
        with odc.minibatch():
            for mb in plan[rank]:
                token_mean_loss(model, [seqs[j] for j in mb], global_tokens, world_size).backward()
    except ODCTimeoutError as first:
        timed_out = first
    try:
        odc.begin()
    except Exception as second:  # noqa: BLE001  (its type is what the test checks)
        return [c.__name__ for c in type(timed_out).__mro__], [c.__name__ for c in type(second).__mro__], str(second)
    return "begin() was not refused"


def refused_setup_then_retry(rank, world_size, seqs, plan):
    """apply_odc refused (a dict for its config), then done right on the same transport and model: the refusal
    leaves nothing allocated. Also a model whose parameters are all frozen: no accumulator, a mini-batch runs."""
    from odc_plugin.fsdp import ODCConfig

    model = sharded_model(rank, world_size)
    transport = make_transport("shm")
    mapped = transport.mapped_bytes()
    refusal = _refusal(lambda: apply_odc(model, transport, {"barrier_timeout_s": 5}))
    left = transport.mapped_bytes() - mapped
    odc = apply_odc(model, transport, ODCConfig(barrier_timeout_s=30))
    global_tokens = count_targets(seqs)
    with odc.minibatch():
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[j] for j in mb], global_tokens, world_size).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    odc.close()

    frozen = sharded_model(rank, world_size)
    frozen.requires_grad_(False)
    frozen_odc = apply_odc(frozen, make_transport("shm"))
    with frozen_odc.minibatch(backward=False), torch.no_grad():
        frozen(seqs[0][None])
    accumulator = frozen_odc.memory_bytes().accumulator
    frozen_odc.close()
    return refusal, left, grads, accumulator


class OutOfMemoryAt(DelegatingTransport):
    """The real transport, whose allocation of region `at` raises MemoryError once on this rank, as an
    allocator out of memory does: before the rank joins any step of the collective set-up."""

    def __init__(self, inner):
        super().__init__(inner)
        self.at: str | None = None

    def alloc(self, name, numel, dtype, timeout_s=SETUP_TIMEOUT_S):
        if name == self.at:
            self.at = None
            raise MemoryError(f"{INJECTED}: out of memory allocating '{name}' on rank {self.rank}")
        return super().alloc(name, numel, dtype, timeout_s)


# The regions build() allocates, in its order: the first, and the last (after the others were built).
BUILD_FAILS_AT = ("odc.params", "odc.grads")


def failed_builds_then_retry(rank, world_size, retried, culprit, device="cpu"):
    """apply_odc (the first build) and release(), then a build() in which rank `culprit` runs out of
    memory at each region of BUILD_FAILS_AT in turn, then a build that succeeds and one mini-batch with an
    AdamW step (`retried`: sequences and plan). Returns what this rank raised and how long each failed
    build took, what its transport's regions held after them, and the trained parameters."""
    model = sharded_model(rank, world_size, device=device)
    transport = OutOfMemoryAt(make_transport(TRANSPORT[device]))
    odc = apply_odc(model, transport)
    odc.release()
    failures = []
    for region in BUILD_FAILS_AT:
        transport.at = region if rank == culprit else None
        start = time.monotonic()
        try:
            odc.build()
            outcome = "built"
        except Exception as e:  # noqa: BLE001  (what each rank raised is the result)
            outcome = f"{type(e).__name__}: {e}"
        failures.append((outcome, time.monotonic() - start, transport.held_bytes()))
    odc.build()
    seqs, plan = retried
    good_minibatch(model, odc, _adamw(model), rank, world_size, on_device(seqs, device), plan)
    params = full_params(model)
    odc.close()
    return {"failures": failures, "params": params}
