"""The four rows of a fair A/B, and the factor each step between them buys.

  fsdp2+lb_micro     stock FSDP2 on its own collectives (gloo on CPU, NCCL on GPUs), LB-Micro's plan
  lockstep+lb_micro  ODC's transport and code with a barrier before every gather and scatter: FSDP's
                     synchronization, ODC's bytes
  odc+lb_micro       ODC on the same plan: ranks meet once per mini-batch
  odc+lb_mini        ODC on LB-Mini's plan: each rank's total work balanced, micro-batch counts free

Row 1 -> 2 is the transport, 2 -> 3 the removed barriers, 3 -> 4 LB-Mini. What the paper's idea buys is
row 2 -> 4, on one transport. Every row trains its own copy of the same weights in the same processes,
on the same samples, so final parameters must agree. A fifth row may join them:

  odc+lb_mini_auto   ODC on LB-Mini's plan with the `auto` cost: fitted while training from the
                     micro-batch times this row measures, each rank's speed included

and a sixth (`--split`):

  odc+lb_mini+split  ODC on LB-Mini's plan with the mini-batch's longest samples split over Ulysses groups
                     of ranks, run first, where that is predicted faster (odc_plugin/balance/split.py)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import make_transport
from ..fsdp import ODCConfig, OnDemandComm, apply_odc
from .timeline import CommClock, TimedTransport, breakdown, time_fsdp_collectives

ROWS = ("fsdp2+lb_micro", "lockstep+lb_micro", "odc+lb_micro", "odc+lb_mini")
FACTORS = {  # name: (slower row, faster row)
    "transport": (ROWS[0], ROWS[1]),
    "barrier_removal": (ROWS[1], ROWS[2]),
    "lb_mini": (ROWS[2], ROWS[3]),
    "odc+lb_mini": (ROWS[1], ROWS[3]),  # the headline: the idea on one transport
}
AUTO_ROW = "odc+lb_mini_auto"
FACTORS["auto"] = (ROWS[3], AUTO_ROW)  # the online fit over the static cost
FACTORS["lb_mini_auto"] = (ROWS[2], AUTO_ROW)  # LB-Mini with the online fit over LB-Micro
SPLIT_ROW = "odc+lb_mini+split"
FACTORS["split"] = (ROWS[3], SPLIT_ROW)  # splitting the longest samples, over LB-Mini's plan


def turn_order(step: int, rows: tuple[str, ...] = ROWS) -> tuple[str, ...]:
    """The rows in the order they train mini-batch `step`: rotated every step, so each row takes each
    turn (the first of a mini-batch's rows meets the caches the last one left)."""
    k = step % len(rows)
    return rows[k:] + rows[:k]


def plan_of(row: str) -> str:
    return row.rsplit("+", 1)[1]


@dataclass
class Row:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    clock: CommClock
    odc: OnDemandComm | None  # None: stock FSDP2


def build_rows(
    build_model: Callable[[], nn.Module], transport: str, lr: float, names: tuple[str, ...] = ROWS
) -> dict[str, Row]:
    """One copy of the `fully_shard`-ed model per row (collective: every rank calls it)."""
    rows = {}
    for name in names:
        model, clock = build_model(), CommClock()
        if name == "fsdp2+lb_micro":
            time_fsdp_collectives(model, clock)
            odc = None
        else:
            odc = apply_odc(
                model, TimedTransport(make_transport(transport), clock), ODCConfig(lockstep=name.startswith("lockstep"))
            )
        # foreach: one multi-tensor step instead of a Python loop over DTensors (5x less CPU per step)
        rows[name] = Row(model, torch.optim.AdamW(model.parameters(), lr=lr, foreach=True), clock, odc)
    return rows


def _sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_minibatch(row: Row, losses: list[Callable[[], torch.Tensor]], device: str = "cpu") -> dict:
    """One optimizer step over these micro-batch losses, timed from a common start to a common end."""
    _sync_device(device)
    dist.barrier()
    start = time.perf_counter()
    row.clock.clear()
    if row.odc:
        row.odc.begin()
    micro_batch_s = []  # each micro-batch's wall time, what the `auto` cost is fitted to
    for loss in losses:
        began = time.perf_counter()
        loss().backward()
        micro_batch_s.append(time.perf_counter() - began)
    if row.odc:
        row.odc.end()
    torch.nn.utils.clip_grad_norm_(row.model.parameters(), 1.0)
    row.optimizer.step()
    row.optimizer.zero_grad()
    _sync_device(device)
    own = time.perf_counter() - start
    intervals, wait_cpu = row.clock.take(start)
    dist.barrier()
    return {
        "step_s": time.perf_counter() - start,
        "own_s": own,
        "intervals": intervals,
        "wait_cpu_s": wait_cpu,
        "micro_batches": len(losses),
        "micro_batch_s": micro_batch_s,
    }


def infer_minibatch(row: Row, forwards: list[Callable[[], torch.Tensor]], device: str = "cpu") -> dict:
    """One forward-only mini-batch (a log-prob or value pass): no gradient, no optimizer step."""
    _sync_device(device)
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        if row.odc:
            row.odc.begin(backward=False)
        for forward in forwards:
            forward()
        if row.odc:
            row.odc.end()
    _sync_device(device)
    own = time.perf_counter() - start
    dist.barrier()
    return {"step_s": time.perf_counter() - start, "own_s": own, "micro_batches": len(forwards)}


def step_breakdown(records: list[dict]) -> list[dict]:
    """Per rank compute / communication / waiting of one mini-batch from every rank's record of it."""
    step = max(r["step_s"] for r in records)
    return breakdown(step, [r["own_s"] for r in records], [r["intervals"] for r in records])


def factors(step_s: dict[str, list[float]]) -> dict[str, float]:
    """Each factor as the median over mini-batches of the per-mini-batch ratio (the rows alternate, so a
    mini-batch's rows ran back to back under the same machine noise)."""
    return {
        name: statistics.median(a / b for a, b in zip(step_s[slow], step_s[fast]))
        for name, (slow, fast) in FACTORS.items()
        if slow in step_s and fast in step_s
    }


def final_param_diff(rows: dict[str, Row]) -> float:
    """Largest |difference| of any parameter between any row and the first (collective)."""
    final = {
        name: {n: p.full_tensor().detach().float() for n, p in row.model.named_parameters()}
        for name, row in rows.items()
    }
    ref = final[ROWS[0]]
    return max((params[n] - ref[n]).abs().max().item() for params in final.values() for n in ref)


def odc_extra_bytes(rows: dict[str, Row]) -> tuple[int, int]:
    """What ODC holds beyond stock FSDP2 on this rank, in bytes, measured from the regions of the ODC rows
    (the largest: they share the model, the lockstep row its regions too), and the elements of the rank's
    shards. Summed over ranks before dividing: a small model's shards can be nearly empty on some rank at
    many ranks, which only its fixed flags and padding would then measure."""
    memory = max((row.odc.memory_bytes() for row in rows.values() if row.odc), key=lambda m: m.regions)
    return memory.regions - memory.grad_storage, memory.shard_numel
