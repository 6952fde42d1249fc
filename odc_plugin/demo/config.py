"""What one `odc-demo` run trains: ranks, model, workload, and whether layer compute is emulated."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..balance import load_lengths
from ..balance.split import UlyssesModel
from ..layer_time import EmulationFit, parse_slow_ranks
from ..models import MODEL_SIZES, qwen2_config

WORKLOADS = ("rl", "sft")
COSTS = ("fit", "auto")
# With emulation the model computes on sequences this many times shorter than the true ones.
EMULATED_STAND_IN = 64
# Samples per rank in the default mini-batch: several, as verl jobs have; with one or fewer per rank
# nothing can be balanced and every row runs the longest sample.
SAMPLES_PER_RANK = 8
# One rank per core, at least two (a single rank has no one to communicate with).
DEFAULT_RANKS = max(2, os.cpu_count() or 2)


@dataclass
class DemoConfig:
    ranks: int = DEFAULT_RANKS
    steps: int = 8
    # None: "small", or "stand-in" with emulation (a model whose own compute costs next to nothing)
    model_size: str | None = None
    workload: str = "rl"
    lengths: str | None = None  # a file of sample lengths; default: the workload's generator
    # prompts per mini-batch (rl), samples per mini-batch (sft); None: SAMPLES_PER_RANK samples per rank
    # (rl: 2 prompts of 4 responses per rank), with the default token budget several micro-batches per rank
    mini_batch_size: int | None = None
    group_size: int = 4  # GRPO responses per prompt (rl)
    max_prompt_length: int = 128
    max_response_length: int = 2048
    # per micro-batch, like verl's ppo_max_token_len_per_gpu (just above the longest RL sample, as
    # verl users set it); sft: also the longest sample
    max_token_len: int = 2304
    seed: int = 0
    out_dir: str = "odc_reports"
    # a cost calibration JSON (benchmarks/calibrate_cost.py): every decoder layer takes the time it
    # gives for the true lengths; None: real compute, with a cost fit calibrated on this CPU
    emulate: str | None = None
    # emulated seconds = the fit's seconds times this; "auto" (the default with emulation): a rank's fair
    # share of a mini-batch takes about layer_time.AUTO_SHARE_S; None: "auto" with emulation, else 1
    time_scale: float | str | None = None
    # the model computes on sequences this many times shorter than the true ones; None: 64 with
    # emulation, else 1
    stand_in: int | None = None
    # "R:F[,R:F]": rank R's layers take F times as long (emulated, or as measured without a fit)
    slow_ranks: str | None = None
    # "fit": LB-Mini balances with the calibrated (or emulated) fit; "auto" adds a fifth row whose
    # LB-Mini balances with the `auto` cost, fitted while it trains (rows.AUTO_ROW)
    cost: str = "fit"
    # adds a row, odc+lb_mini+split (rows.SPLIT_ROW): LB-Mini with a mini-batch's longest samples split over
    # Ulysses groups of ranks where that is predicted faster (odc_plugin/balance/split.py)
    split: bool = False
    slowdowns: list[float] = field(init=False)

    def __post_init__(self):
        if self.ranks < 1:
            raise ValueError(f"--ranks must be >= 1, got {self.ranks}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.model_size is None:
            self.model_size = "stand-in" if self.emulate else "small"
        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"--model-size must be one of {', '.join(MODEL_SIZES)}, got '{self.model_size}'")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got '{self.workload}'")
        if self.mini_batch_size is None:
            per_rank = SAMPLES_PER_RANK // self.group_size if self.workload == "rl" else SAMPLES_PER_RANK
            self.mini_batch_size = per_rank * self.ranks
        if self.mini_batch_size < 1:
            raise ValueError(f"--mini-batch-size must be >= 1, got {self.mini_batch_size}")
        for flag, value in (
            ("--max-prompt-length", self.max_prompt_length),
            ("--max-response-length", self.max_response_length),
            ("--max-token-len", self.max_token_len),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.lengths is not None:
            try:
                load_lengths(self.lengths)  # a bad file fails here, before any rank starts
            except (ValueError, OSError) as e:
                where = "" if self.lengths in str(e) else f"{self.lengths}: "
                raise ValueError(
                    f"--lengths: {where}{e} (give a JSON list, a text file of one integer per line, "
                    "or file.parquet:column)"
                ) from None
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise ValueError(f"--out-dir {self.out_dir} is a file: name a directory (created if missing)")
        if self.workload == "rl" and self.max_prompt_length + self.max_response_length > self.max_token_len:
            raise ValueError(
                f"--max-token-len {self.max_token_len} is below the longest possible sample "
                f"({self.max_prompt_length} + {self.max_response_length})"
            )
        if self.time_scale is None:
            self.time_scale = "auto" if self.emulate else 1.0
        if self.time_scale != "auto" and not (
            isinstance(self.time_scale, (int, float)) and math.isfinite(self.time_scale) and self.time_scale > 0
        ):
            raise ValueError(f"--time-scale must be a finite number > 0 or 'auto', got {self.time_scale!r}")
        if self.time_scale != 1.0 and not self.emulate:
            raise ValueError("--time-scale scales emulated compute: it needs --emulate")
        if self.emulate:
            EmulationFit.load(self.emulate)  # a bad file fails here, before any rank starts
        if self.stand_in is None:
            self.stand_in = EMULATED_STAND_IN if self.emulate else 1
        if self.stand_in < 1:
            raise ValueError(f"--stand-in must be >= 1, got {self.stand_in}")
        if self.cost not in COSTS:
            raise ValueError(f"--cost must be one of {', '.join(COSTS)}, got {self.cost!r}")
        slow = parse_slow_ranks(self.slow_ranks, self.ranks)
        self.slowdowns = [slow.get(r, 1.0) for r in range(self.ranks)]
        if self.split and len(self.ulysses().group_sizes(self.ranks)) == 1:
            raise ValueError(
                f"--split: the attention heads of {self.emulate and 'the emulated model' or self.model_size} "
                f"divide over no group of 2 or more of the {self.ranks} ranks (a power of two dividing the rank "
                f"count, at most 8); pick another --ranks or --model-size"
            )

    def ulysses(self) -> UlyssesModel:
        """What splitting a sample costs beside its compute: the all-to-alls of the emulated model (modelled
        over NVLink), or of the model that computes (a node's worth of ranks on this machine)."""
        if self.emulate:
            return UlyssesModel.from_config(EmulationFit.load(self.emulate).model)
        return UlyssesModel.from_config(qwen2_config(self.model_size), gpus_per_node=min(self.ranks, 8))

    @property
    def samples_per_minibatch(self) -> int:
        return self.mini_batch_size * (self.group_size if self.workload == "rl" else 1)
