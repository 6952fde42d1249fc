"""Per-rank bodies of the ODC core tests (module-level so spawned ranks can import them).

`device` "cpu" runs ODC over the shared-memory transport; "cuda" over CUDA IPC, each rank on GPU
rank % device_count (all on GPU 0 when there is one). The process group is gloo either way: ODC needs
none inside a mini-batch, and NCCL refuses several ranks on one GPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from odc_plugin.comm import make_transport
from odc_plugin.fsdp import ODCConfig, apply_odc
from odc_plugin.fsdp.ulysses import SequenceGroups
from odc_plugin.models import build_qwen2, build_qwen3_moe, shard_qwen2, split_sample_loss, token_mean_loss
from odc_plugin.moe import ExpertRouting

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
        name: DTensor.from_local(
            t.to_local().detach().cpu(), cpu_mesh, t.placements, shape=t.shape, stride=t.stride()
        ).full_tensor()
        for name, t in tensors.items()
    }


def full_grads(model) -> dict[str, torch.Tensor]:
    missing = {n: torch.zeros(p.shape) for n, p in model.named_parameters() if p.grad is None}
    return _full_on_cpu({n: p.grad for n, p in model.named_parameters() if p.grad is not None}) | missing


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in _full_on_cpu(dict(model.named_parameters())).items()}


MODELS = {
    "qwen2": lambda: build_qwen2("tiny", seed=0),
    "qwen3_moe": lambda: build_qwen3_moe(seed=0),
    # 4 heads, 2 kv heads: its attention splits over 2 and 4 ranks (tiny's 5 heads over none)
    "qwen2_small": lambda: build_qwen2("small", seed=0),
}


def sharded_model(rank: int, world_size: int, mixed_precision: bool = False, device: str = "cpu", arch="qwen2"):
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    return shard_qwen2(MODELS[arch]().to(device), mesh, mp)


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
    sizes = {
        "params_bytes": odc.params.numel,
        "grads_numel": odc.grad_numel,
        "model_numel": sum(p.numel() for p in model.parameters()),
        "padding_bound": sum(p.numel() // p.shape[0] for p in model.parameters()),
    }
    return full_grads(model), sizes


def train_steps(rank, world_size, seqs, plan, steps, use_odc, mixed_precision, device="cpu", arch="qwen2"):
    """`steps` AdamW steps with grad clipping; the same per-rank micro-batches every step."""
    model = sharded_model(rank, world_size, mixed_precision, device, arch)
    odc = apply_odc(model, make_transport(TRANSPORT[device])) if use_odc else None
    return adamw_steps(model, odc, rank, world_size, on_device(seqs, device), plan, steps)


def calibrated_train_steps(rank, world_size, seqs, plan, steps, methods):
    """train_steps over shm after a calibration among `methods` (None: every one) chose the accumulate
    method; also what it measured."""
    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"))
    odc.release()
    calibration = odc.calibrate(methods, repeats=1)
    odc.build()
    return adamw_steps(model, odc, rank, world_size, seqs, plan, steps), calibration, odc.memory_bytes()


def train_moe_steps(rank, world_size, seqs, plan, steps):
    """train_steps of the tiny MoE under ODC; also the tokens this rank routed to each expert, per step."""
    model = sharded_model(rank, world_size, arch="qwen3_moe")
    odc = apply_odc(model, make_transport("shm"))
    routing, counts = ExpertRouting(model), []
    params = adamw_steps(model, odc, rank, world_size, seqs, plan, steps, lambda: counts.append(routing.take()))
    return params, counts


def minibatch_backward(
    model, odc, rank, world_size, seqs, plan, global_tokens, before_end=lambda: None, after_begin=lambda: None
) -> None:
    """This rank's micro-batches of one mini-batch, forward and backward; inside ODC's begin/end with odc,
    `after_begin` called before the first micro-batch and `before_end` after the last backward, while the
    mini-batch is open."""
    if odc:
        odc.begin()
    after_begin()
    for mb in plan[rank]:
        token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
    before_end()
    if odc:
        odc.end()


def split_train_steps(rank, world_size, seqs, splits, plan, steps):
    """adamw_steps of the 4-head Qwen2 under ODC: each mini-batch first runs the `splits` (sample, block of
    ranks) this rank is in, each split over its block, then this rank's plan[rank]."""
    model = sharded_model(rank, world_size, arch="qwen2_small")
    odc = apply_odc(model, make_transport("shm"))
    groups = SequenceGroups(max_group=world_size)
    global_tokens = count_targets(seqs)

    def run_splits() -> None:
        for sample, ranks in splits:
            if rank in ranks:
                with groups.split(ranks) as split:
                    split_sample_loss(model, seqs[sample], global_tokens, world_size, split).backward()

    return adamw_steps(model, odc, rank, world_size, seqs, plan, steps, after_begin=run_splits)


def split_refusals(rank, world_size):
    """What each wrong split says on this rank (of 4): a group size that is not a power of two, ranks that
    are not a block, a block this rank is not in, attention heads that do not divide over the block."""

    def refusal(attempt) -> str | None:
        try:
            attempt()
        except ValueError as e:
            return str(e)
        return None

    messages = [refusal(lambda: SequenceGroups(max_group=3))]
    groups = SequenceGroups(max_group=world_size)
    messages.append(refusal(lambda: groups.split((0, 2)).__enter__()))
    messages.append(refusal(lambda: groups.split((2, 3) if rank < 2 else (0, 1)).__enter__()))
    model = build_qwen2("tiny", seed=0)  # 5 heads
    with groups.split((0, 1) if rank < 2 else (2, 3)) as split:
        messages.append(refusal(lambda: split_sample_loss(model, torch.arange(9), 8, world_size, split)))
    return messages


def adamw_steps(model, odc, rank, world_size, seqs, plan, steps, after_step=lambda: None, after_begin=lambda: None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    global_tokens = count_targets(seqs)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        minibatch_backward(model, odc, rank, world_size, seqs, plan, global_tokens, after_begin=after_begin)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        after_step()
    return full_params(model)


def _collective_names() -> list[str]:
    """Every public torch.distributed function that takes a process group, bar the pure getters."""
    import inspect

    c10d = dist.distributed_c10d
    return [
        name
        for name in c10d.__all__
        if inspect.isfunction(getattr(c10d, name, None))
        and "group" in inspect.signature(getattr(c10d, name)).parameters
        and not name.startswith(("get_", "destroy_", "new_", "shrink_"))
    ]


@contextlib.contextmanager
def collectives_called():
    """Records every torch.distributed collective called inside, as (name, ranks of its group)."""
    import inspect

    calls: list[tuple[str, tuple[int, ...]]] = []
    originals = {name: getattr(dist.distributed_c10d, name) for name in _collective_names()}

    def recording(name, fn):
        signature = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
            calls.append((name, ranks))
            return fn(*args, **kwargs)

        return wrapper

    modules = (dist, dist.distributed_c10d)
    for mod in modules:
        for name, fn in originals.items():
            setattr(mod, name, recording(name, fn))
    try:
        yield calls
    finally:
        for mod in modules:
            for name, fn in originals.items():
                setattr(mod, name, fn)


def count_collectives_in_minibatch(rank, world_size, seqs, plan, use_odc):
    """Counts every torch.distributed collective called between begin() and end() on this rank."""
    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm")) if use_odc else None
    global_tokens = count_targets(seqs)
    if odc:
        odc.begin()
    with collectives_called() as calls:
        for mb in plan[rank]:
            token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size).backward()
    if odc:
        odc.end()
    return [name for name, _ in calls]


def die_mid_minibatch(rank, world_size, seqs, plan, victim, timeout_s):
    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"), ODCConfig(barrier_timeout_s=timeout_s))
    return train_until_victim_dies(model, odc, rank, world_size, seqs, plan, victim)


def train_until_victim_dies(model, odc, rank, world_size, seqs, plan, victim):
    """One mini-batch in which rank `victim` dies after its first forward, before pushing any gradient."""
    import os

    global_tokens = count_targets(seqs)
    odc.begin()
    for mb in plan[rank]:
        loss = token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size)
        if rank == victim:
            os._exit(17)  # dies after its forward, before pushing any gradient
        loss.backward()
    odc.end()
    return "unreachable"


def _exit_once_created(region: str, code: int = 17) -> None:
    """Kill this process the moment it has created its own file of shm region `region`, before it maps its
    peers' files. Hooked into this process's own set-up (not a watch of /dev/shm, which would also see the
    files of other tests running beside this one)."""
    import os

    from odc_plugin.comm import shm

    init = shm._Mapping.__init__

    def creating(self, path, nbytes, create):
        init(self, path, nbytes, create)
        if create and path.rsplit("-", 3)[-3] == region:  # .../odc-<token>-<region>-r<rank>-p<pid>
            os._exit(code)

    shm._Mapping.__init__ = creating


def die_during_setup(rank, world_size, victim, stage):
    """`victim` dies the moment it has created its own file of the first region `stage` ("make_transport"
    or "apply_odc") sets up: its peers come 1 s later, so it dies between creating the file and mapping its
    peers'. The survivors' set-up must fail and leave no file behind."""
    import time

    if stage == "make_transport":
        if rank == victim:
            _exit_once_created("odc.doorbell")
        else:
            time.sleep(1.0)
        make_transport("shm")
        return "set up"
    model = sharded_model(rank, world_size)
    transport = make_transport("shm")
    if rank == victim:
        _exit_once_created("odc.params")
    else:
        time.sleep(1.0)
    apply_odc(model, transport)
    return "set up"


# A model whose modules a micro-batch touches depend on its data, as in MoE and multi-modal models.
ROUTED_VOCAB, ROUTED_DIM, EXPERTS = 23, 10, 4


class RoutedModel(torch.nn.Module):
    """Every token goes through the embedding and the head; a sample with an image adds a tower's
    features; each token also goes through one expert, chosen by its id (id % EXPERTS), so an expert
    runs only in micro-batches that hold its tokens."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.embed = nn.Embedding(ROUTED_VOCAB, ROUTED_DIM)
        self.tower = nn.Sequential(
            nn.Linear(ROUTED_DIM, 2 * ROUTED_DIM), nn.Tanh(), nn.Linear(2 * ROUTED_DIM, ROUTED_DIM)
        )
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(ROUTED_DIM, 2 * ROUTED_DIM), nn.GELU(), nn.Linear(2 * ROUTED_DIM, ROUTED_DIM))
            for _ in range(EXPERTS)
        )
        self.head = nn.Linear(ROUTED_DIM, ROUTED_VOCAB)

    def forward(self, samples) -> torch.Tensor:
        """Summed next-token loss of `samples`, (tokens, image or None) pairs, in one call per module."""
        lengths = [len(t) for t, _ in samples]
        tokens = torch.cat([t for t, _ in samples])
        h = self.embed(tokens)
        with_image = [i for i, (_, image) in enumerate(samples) if image is not None]
        if with_image:
            rows = self.tower(torch.cat([samples[i][1] for i in with_image]))
            features = rows.view(len(with_image), -1, ROUTED_DIM).mean(1)
            per_sample = features.new_zeros(len(samples), ROUTED_DIM).index_copy(0, torch.tensor(with_image), features)
            h = h + per_sample.repeat_interleave(torch.tensor(lengths), dim=0)
        out = h
        for e, expert in enumerate(self.experts):
            idx = (tokens % EXPERTS == e).nonzero().squeeze(1)
            if len(idx):
                out = out.index_add(0, idx, expert(h[idx]))
        logits = self.head(torch.tanh(out)).float()
        return sum(
            torch.nn.functional.cross_entropy(lg[:-1], t[1:], reduction="sum")
            for lg, (t, _) in zip(logits.split(lengths), samples)
        )


def routed_sample(seed: int, experts: tuple[int, ...], image: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sample whose tokens go to `experts`, each at least once, and to no other; with a 3-row image
    when `image`."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([v for v in range(ROUTED_VOCAB) if v % EXPERTS in experts])
    extra = allowed[torch.randint(len(allowed), (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)]
    tokens = torch.cat([torch.tensor(experts), extra])[torch.randperm(len(experts) + len(extra), generator=g)]
    return tokens, torch.randn(3, ROUTED_DIM, generator=g) if image else None


def build_routed(seed: int = 0) -> RoutedModel:
    torch.manual_seed(seed)
    return RoutedModel()


def routed_targets(micro_batches) -> int:
    return sum(len(t) - 1 for mb in micro_batches for t, _ in mb)


def train_routed(rank, world_size, steps, eval_batch, use_odc, reshard_after_forward=None, mixed_precision=False):
    """Per step: a forward-only mini-batch over this rank's `score` micro-batches, an evaluation forward
    of `eval_batch` on every rank (FSDP's own collectives, outside any mini-batch), then a training
    mini-batch over its `train` micro-batches and an AdamW step with weight decay and grad clipping.
    Returns the final parameters and, per step, the scores, the evaluation loss and which parameters
    had no gradient."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mesh": mesh, "mp_policy": mp or MixedPrecisionPolicy()}
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    model = build_routed()
    for module in [model.tower, *model.experts]:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    odc = apply_odc(model, make_transport("shm"), ODCConfig(barrier_timeout_s=60)) if use_odc else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    records = []
    for step in steps:
        with odc.minibatch(backward=False) if odc else contextlib.nullcontext(), torch.no_grad():
            scores = [model(mb).item() for mb in step["score"][rank]]
        with torch.no_grad():
            evaluation = model(eval_batch).item()
        opt.zero_grad(set_to_none=True)
        global_targets = routed_targets([mb for share in step["train"] for mb in share])
        with odc.minibatch() if odc else contextlib.nullcontext():
            for mb in step["train"][rank]:
                (model(mb) / global_targets * world_size).backward()
        no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        records.append({"scores": scores, "eval": evaluation, "no_grad": no_grad})
    return full_params(model), records


def cpu_while_waiting(rank, world_size, late_s):
    """Rank 1 publishes and reaches the barrier `late_s` late; rank 0 reports the CPU seconds it spent
    waiting for its shards (the first gather of the forward) and at the end-of-mini-batch barrier."""
    import time

    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"), ODCConfig(barrier_timeout_s=60))
    seqs = make_sequences(2, seed=1)
    spent = {}
    if rank == 1:
        time.sleep(late_s)
    odc.begin()
    cpu, wall = time.process_time(), time.perf_counter()
    loss = token_mean_loss(model, seqs, count_targets(seqs), world_size)
    spent["published"] = (time.process_time() - cpu, time.perf_counter() - wall)
    loss.backward()
    if rank == 1:
        time.sleep(late_s)
    cpu, wall = time.process_time(), time.perf_counter()
    odc.end()
    spent["barrier"] = (time.process_time() - cpu, time.perf_counter() - wall)
    return spent


def raise_mid_minibatch(rank, world_size, seqs, plan, culprit):
    """Rank `culprit` raises inside `minibatch()` (an out-of-memory its caller could catch and retry);
    the barrier timeout stays at its default, 600 s. Returns what each rank saw, how long it took, and on
    the culprit whether a new begin() is accepted afterwards."""
    import time

    model = sharded_model(rank, world_size)
    odc = apply_odc(model, make_transport("shm"))
    global_tokens = count_targets(seqs)
    start = time.monotonic()
    try:
        with odc.minibatch():
            for mb in plan[rank]:
                loss = token_mean_loss(model, [seqs[i] for i in mb], global_tokens, world_size)
                if rank == culprit:
                    raise RuntimeError("simulated out of memory")
                loss.backward()
        outcome = "finished"
    except Exception as e:  # noqa: BLE001  (what each rank raised is the result)
        outcome = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    retried = None
    if rank == culprit:
        odc.begin()
        retried = odc.in_minibatch
    return outcome, elapsed, retried
