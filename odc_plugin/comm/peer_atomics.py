"""Whether adds into a peer's memory are exact, checked at start instead of trusted.

The cuda_ipc transport adds gradients into peers' accumulators with system-scope fp32 atomics. They are
exact where the GPUs have native peer atomics (NVLink); over PCIe a GPU's atomics into another GPU's
memory are not guaranteed, and lost or torn updates would give wrong gradients with no error. So the
transport runs the real kernel once when it starts (`run_probe`): every rank adds an integer-valued
pattern, several rounds over, into every rank's memory, into a range of its own (which names the pair
of GPUs that fails) and into one range all of them hit at once (which needs atomicity); each owner checks
the sums, which are exact in fp32. Where a process sees both GPUs of a pair, CUDA is also asked whether
they have native peer atomics (`native_atomics`). Every rank gathers every rank's findings and reaches
the same decision (`probe_error`, a pure function tested on CPU), so all fail at start with one line, or
none does. The same probe checks the "slots" method (slots.py), whose adds need no peer atomics: there a
wrong sum means the link loses plain writes, and CUDA's answer about atomics does not matter.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import Transport
from .failure import ODCPeerFailedError

ELEMENTS = 16 * 4096  # per range: whole tiles of the accumulate kernel, so its vector path runs
ROUNDS = 4
TIMEOUT_S = 600.0
_PERIOD = 5  # the pattern: element i of sender s adds (s + 1) * (i % 5 + 1)
# CUdevice_P2PAttribute's CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED (cuda.h).
_NATIVE_ATOMIC_SUPPORTED = 3


class PeerAddsError(RuntimeError):
    """The start-up check found adds into a peer's memory that are not exact (the same on every rank)."""


@dataclass(frozen=True)
class Mismatch:
    """The first wrong sum an owner found in one range of its probe region."""

    owner: int
    sender: int | None  # whose own range; None for the range every sender adds into at once
    index: int
    expected: float
    got: float


def _pattern(numel: int, device) -> torch.Tensor:
    return (torch.arange(numel, device=device) % _PERIOD + 1).to(torch.float32)


def run_probe(transport: Transport) -> list[Mismatch]:
    """Collective: every rank adds the pattern into every rank's probe region with `transport.accumulate`,
    meets the others at a barrier, and checks its own region. Returns this rank's mismatches (empty when
    every sum is exact). The region is freed again (collectively) once its sums are read."""
    world, me = transport.world_size, transport.rank
    region = transport.alloc("odc.probe", (world + 1) * ELEMENTS, torch.float32)
    pattern = _pattern(ELEMENTS, region.local.device)
    mine = pattern * (me + 1)
    for _ in range(ROUNDS):
        for step in range(world):
            owner = (me + step) % world  # each rank starts with another owner
            transport.accumulate(region, owner, me * ELEMENTS, mine)
            transport.accumulate(region, owner, world * ELEMENTS, mine)
    transport.barrier(TIMEOUT_S)
    sums = region.local.view(world + 1, ELEMENTS).to("cpu", copy=True)
    del region  # the transport frees what no tensor of ours still points into
    transport.free("odc.probe")
    pattern = pattern.cpu()
    expected = [pattern * (ROUNDS * (s + 1)) for s in range(world)]
    expected.append(pattern * (ROUNDS * world * (world + 1) // 2))
    mismatches = []
    for row, (got, want) in enumerate(zip(sums, expected)):
        wrong = (got != want).nonzero()
        if len(wrong):
            i = int(wrong[0])
            sender = row if row < world else None
            mismatches.append(Mismatch(me, sender, i, float(want[i]), float(got[i])))
    return mismatches


def native_atomics(device: int, peer_devices: Sequence[int | None]) -> list[bool | None]:
    """For each peer's device index in this process (None where the process does not see that GPU, or it
    is this rank's own), whether CUDA reports native atomics from `device` to it; None where it cannot tell."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return [None] * len(peer_devices)

    def handle(index: int):
        dev = ctypes.c_int()
        return dev if cuda.cuDeviceGet(ctypes.byref(dev), index) == 0 else None

    answers: list[bool | None] = []
    for peer in peer_devices:
        src, dst = handle(device), None if peer is None or peer == device else handle(peer)
        value = ctypes.c_int()
        if src is None or dst is None:
            answers.append(None)
        elif cuda.cuDeviceGetP2PAttribute(ctypes.byref(value), _NATIVE_ATOMIC_SUPPORTED, src, dst) == 0:
            answers.append(bool(value.value))
        else:
            answers.append(None)
    return answers


def probe_error(
    mismatches: Sequence[Mismatch],
    gpus: Sequence[str],
    native: Sequence[Sequence[bool | None]],
    method: str = "direct",
    transport: str = "cuda_ipc",
) -> str | None:
    """The one-line error every rank raises at start, or None. `mismatches` from every rank, `gpus[r]`
    the GPU of rank r (its UUID), `native[r][p]` what CUDA told rank r of atomics into rank p's GPU,
    `method` the accumulate method checked ("direct": peer atomics, "slots": plain adds, no atomics),
    `transport` the name the error starts with."""
    if method == "slots":
        checked = "peer adds (odc_accumulate=slots)"
        advice = (
            "writes into a peer's memory are lost on this link, so ODC cannot add gradients there; use strategy=fsdp2"
        )
    else:
        checked = "peer atomics"
        advice = (
            "these GPUs lack native peer atomics (e.g. PCIe without NVLink), so gradients added into a peer's memory "
            "can be wrong; set odc_accumulate=slots or auto (adds without peer atomics), or use strategy=fsdp2"
        )
        for sender, answers in enumerate(native):
            for owner, answer in enumerate(answers):
                if answer is False:
                    return (
                        f"{transport}: CUDA reports no native atomics from rank {sender}'s GPU {gpus[sender]} to rank "
                        f"{owner}'s GPU {gpus[owner]}: {advice}"
                    )
    if not mismatches:
        return None
    # a sender's own range names the pair of GPUs; the shared one only that concurrent adds went wrong
    first = min(mismatches, key=lambda m: (m.sender is None, m.owner, m.sender or 0))
    into = f"rank {first.owner}'s GPU {gpus[first.owner]}"
    if first.sender is None:
        what = f"adds from every rank at once into {into}"
    else:
        what = f"adds from rank {first.sender}'s GPU {gpus[first.sender]} into {into}"
    return (
        f"{transport}: the start-up check of {checked} failed: {what} gave {first.got:g} where {first.expected:g} "
        f"was added (element {first.index}; {len(mismatches)} range(s) wrong): {advice}"
    )


def check(transport: Transport, gpus: Sequence[str], peer_devices: Sequence[int | None], group=None) -> float:
    """Collective, when a GPU transport starts: run the probe with the transport's accumulate method, ask
    CUDA, and raise the same one-line PeerAddsError on every rank if any pair of GPUs failed; `gpus[r]` is
    rank r's GPU, `peer_devices[r]` its index in this process (None if not visible). A rank whose probe
    raises announces it, so that no peer waits out the probe's barrier, and every rank raises its message
    (a RuntimeError). Returns the seconds it took."""
    start = time.perf_counter()
    failure = None
    try:
        mismatches = run_probe(transport)
    except Exception as e:  # noqa: BLE001  (every rank raises the gathered failure below)
        mismatches = []
        if not isinstance(e, ODCPeerFailedError):
            transport.announce_failure(f"{type(e).__name__}: {e}")
            failure = (
                f"{transport.name}: rank {transport.rank}: the start-up check of peer atomics raised "
                f"{type(e).__name__}: {e}"
            )
    device = peer_devices[transport.rank]
    report = (failure, mismatches, native_atomics(device, peer_devices) if device is not None else [])
    reports: list = [None] * transport.world_size
    dist.all_gather_object(reports, report, group=group)
    failed = next((f for f, _, _ in reports if f), None)
    if failed:
        raise RuntimeError(failed.splitlines()[0])
    error = probe_error(
        [m for _, ms, _ in reports for m in ms],
        gpus,
        [n for _, _, n in reports],
        transport.accumulate_method,
        transport.name,
    )
    if error:
        raise PeerAddsError(error)
    return time.perf_counter() - start
