"""Per-rank bodies of the ODC core tests (module-level so spawned ranks can import them).

`device` "cpu" runs ODC over the shared-memory transport; "cuda" over CUDA IPC, each rank on GPU
rank % device_count (all on GPU 0 when there is one). The process group is gloo either way: ODC needs
none inside a mini-batch, and NCCL refuses several ranks on one GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import ODCConfig, apply_odc
from odc_plugin.models import build_qwen2, shard_qwen2, token_mean_loss

VOCAB = 101  # the "tiny" size


def make_sequences(n: int, seed: int, min_len: int = 4, max_len: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (n,), generator=g)
    return [torch.randint(0, VOCAB, (int(n_),), generator=g) for n_ in lengths]


def count_targets(seqs) -> int:
    return sum(len(s) - 1 for s in seqs)


TRANSPORT = {"cpu": "shm", "cuda": "cuda_ipc"}


def _full_on_cpu(tensors: dict[str, DTensor | None]) -> dict[str, torch.Tensor]:
    """Whole tensors on CPU, gathered over gloo from CPU copies of the shards (whatever their device)."""
    cpu_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {
        name: DTensor.from_local(t.to_local().detach().cpu(), cpu_mesh, t.placements, shape=t.shape,
                                 stride=t.stride()).full_tensor()
        for name, t in tensors.items()
    }


def full_grads(model) -> dict[str, torch.Tensor]:
    missing = {n: torch.zeros(p.shape) for n, p in model.named_parameters() if p.grad is None}
    return _full_on_cpu({n: p.grad for n, p in model.named_parameters() if p.grad is not None}) | missing


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in _full_on_cpu(dict(model.named_parameters())).items()}


def sharded_model(rank: int, world_size: int, mixed_precision: bool = False, device: str = "cpu"):
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    return shard_qwen2(build_qwen2("tiny", seed=0).to(device), mesh, mp)


def on_device(seqs, device: str) -> list[torch.Tensor]:
    return [s.to(device) for s in seqs]


def odc_grads(rank, world_size, seqs, plan, device="cpu", timeout_s=60.0):
    """One ODC mini-batch: this rank runs plan[rank] (a list of micro-batches of sequence indices)."""
    model = sharded_model(rank, world_size, device=device)
    odc = apply_odc(model, make_transport(TRANSPORT[device]), ODCConfig(barrier_timeout_s=timeout_s))
    seqs = on_device(seqs, device)
    global_tokens = count_targets(seqs)
    with odc.minibatch():
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
    sizes = {"params_bytes": odc.params.numel, "grads_numel": odc.grads.numel,
             "model_numel": sum(p.numel() for p in model.parameters()),
             "padding_bound": sum(p.numel() // p.shape[0] for p in model.parameters())}
    return full_grads(model), sizes


def train_steps(rank, world_size, seqs, plan, steps, use_odc, mixed_precision, device="cpu"):
    """`steps` AdamW steps with grad clipping; the same per-rank micro-batches every step."""
    model = sharded_model(rank, world_size, mixed_precision, device)
    odc = apply_odc(model, make_transport(TRANSPORT[device])) if use_odc else None
    seqs = on_device(seqs, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    global_tokens = count_targets(seqs)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if odc:
            odc.begin()
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
        if odc:
            odc.end()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
    return full_params(model)


def _collective_names() -> list[str]:
    """Every public torch.distributed function that takes a process group, bar the pure getters."""
    import inspect

    c10d = dist.distributed_c10d
    return [
        name for name in c10d.__all__
        if inspect.isfunction(getattr(c10d, name, None))
        and "group" in inspect.signature(getattr(c10d, name)).parameters
        and not name.startswith(("get_", "destroy_", "new_", "shrink_"))
    ]


def count_collectives_in_minibatch(rank, world_size, seqs, plan, use_odc):
    """Counts every torch.distributed collective called between begin() and end() on this rank."""
    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm")) if use_odc else None
    calls: list[str] = []
    originals = {name: getattr(dist.distributed_c10d, name) for name in _collective_names()}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    modules = (dist, dist.distributed_c10d)
    global_tokens = count_targets(seqs)
    if odc:
        odc.begin()
    for mod in modules:
        for name, fn in originals.items():
            setattr(mod, name, counting(name, fn))
    try:
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
    finally:
        for mod in modules:
            for name, fn in originals.items():
                setattr(mod, name, fn)
    if odc:
        odc.end()
    return calls


def die_mid_minibatch(rank, world_size, seqs, plan, victim, timeout_s):
    import os

    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"), ODCConfig(barrier_timeout_s=timeout_s))
    global_tokens = count_targets(seqs)
    odc.begin()
    for mb in plan[rank]:
        loss = token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size)
        if rank == victim:
            os._exit(17)  # dies after its forward, before pushing any gradient
        loss.backward()
    odc.end()
    return "unreachable"


def _exit_when_created(pattern: str, code: int = 17) -> None:
    """Kill this process, from a watcher thread, the moment a file matching `pattern` exists."""
    import glob
    import os
    import threading
    import time

    def watch():
        while not glob.glob(pattern):
            time.sleep(1e-4)
        os._exit(code)

    threading.Thread(target=watch, daemon=True).start()


def die_during_setup(rank, world_size, victim, stage):
    """`victim` dies the moment its own file of the first region `stage` ("make_transport" or
    "apply_odc") sets up appears in /dev/shm: its peers come 1 s later, so it dies between creating the
    file and mapping its peers'. The survivors' set-up must fail and leave no file behind."""
    import time

    if stage == "make_transport":
        if rank == victim:
            _exit_when_created(f"/dev/shm/odc-*-odc.barrier-r{victim}")
        else:
            time.sleep(1.0)
        make_transport("shm")
        return "set up"
    model = sharded_model(rank, world_size)
    transport = make_transport("shm")
    if rank == victim:
        _exit_when_created(f"{transport.path_prefix}-odc.params-r{victim}")
    else:
        time.sleep(1.0)
    apply_odc(model, transport)
    return "set up"
