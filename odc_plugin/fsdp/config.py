"""What `apply_odc` is configured with (ODCConfig), and what it reports: a mini-batch's times
(MiniBatchStats) and the memory ODC holds (ODCMemory)."""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.base import is_positive_finite


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

    trains: bool = True
    """Whether the model is trained. False for a model only ever run forward (a reference model, a user of
    `begin(backward=False)` alone): it gets no gradient accumulator, so ODC adds only the published shards
    to FSDP2's memory, and a backward mini-batch is refused."""

    def __post_init__(self):
        for name in ("lockstep", "trains"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ODCConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not is_positive_finite(self.barrier_timeout_s):
            raise ValueError(f"ODCConfig.barrier_timeout_s must be a finite number > 0, got {self.barrier_timeout_s!r}")
        if self.gradient_divide_factor is not None and not is_positive_finite(self.gradient_divide_factor):
            factor = self.gradient_divide_factor
            raise ValueError(f"ODCConfig.gradient_divide_factor must be a finite number > 0 or None, got {factor!r}")


@dataclass
class MiniBatchStats:
    compute_s: float = 0.0  # begin -> arrival at the barrier
    wait_s: float = 0.0  # time in the barrier


@dataclass(frozen=True)
class ODCMemory:
    """Bytes this rank's ODC holds for one model now (as its transport allocated them), and what they add to
    stock FSDP2's memory. Released (`OnDemandComm.release`), only `control` is left."""

    published: int
    """The parameter shards in the all-gather dtype, which peers get from, and their flag."""
    accumulator: int
    """The fp32 gradient accumulator and its used flags; 0 for a forward-only model."""
    scratch: int
    """The zeros `.grad` points at during a backward mini-batch (the largest shard; 0 outside one), and the
    ones the used flags are added from."""
    staging: int
    """The transport's staging buffers, held while any region is (nvshmem's accumulate slots); else 0."""
    control: int
    """The transport's control words (arrival flags, doorbells, failure notices), held from start to close."""
    grad_storage: int
    """Bytes of sharded `.grad` that FSDP2 would hold and ODC does not, the accumulator being their
    storage (fp32 parameters); 0 when `.grad` is a copy (another parameter dtype) or there is none."""
    shard_numel: int
    """Elements of this rank's parameter shards."""

    @property
    def regions(self) -> int:
        """Everything but the control words: what ODC holds for the model, 0 once released."""
        return self.published + self.accumulator + self.scratch + self.staging

    @property
    def held(self) -> int:
        """Every byte ODC holds for the model, its transport's control words included."""
        return self.regions + self.control

    @property
    def extra_bytes_per_param(self) -> float:
        """What ODC adds to FSDP2 (its control words aside), per element of this rank's shards."""
        return (self.regions - self.grad_storage) / max(self.shard_numel, 1)
