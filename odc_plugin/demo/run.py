"""`odc-demo`: four A/B rows of real FSDP2 and ODC training on CPU processes, and what each step buys.

Every row trains the same small Qwen2-architecture model from the same weights on the same mini-batches,
in the same processes, the rows taking turns mini-batch by mini-batch so that machine noise hits all
alike (rows and factors: odc_plugin/rows.py):

  fsdp2+lb_micro     stock FSDP2 over gloo, samples spread by verl's LB-Micro
  lockstep+lb_micro  FSDP's per-layer synchronization on ODC's shared-memory transport, same spread
  odc+lb_micro       ODC, same spread: ranks meet once per mini-batch
  odc+lb_mini        ODC, samples spread by LB-Mini: each rank's total work balanced

Workloads: GRPO-like RL math rollouts (long-tailed responses, several micro-batches per rank) or
long-context SFT (short chats mixed with long documents). A cost fit a*s^2 + b*s is calibrated on this
CPU first; LB-Mini balances with it and the planner predicts each row's step time from it, printed next
to what was measured. Writes a JSON report and a PNG of per-rank compute / communication / waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .balance import FitCost, lb_micro, lb_mini, load_lengths, rl_math_like, sft_long_context_like
from .balance.costs import fit_quadratic
from .balance.planner import simulate_minibatch
from .launch import run_ranks
from .models import MODEL_SIZES, build_qwen2, next_token_logprobs, shard_qwen2
from .rows import (FACTORS, ROWS, build_rows, factors, final_param_diff, plan_of, step_breakdown, train_minibatch,
                   turn_order)

WORKLOADS = ("rl", "sft")


@dataclass
class DemoConfig:
    ranks: int = max(2, os.cpu_count() or 2)
    steps: int = 8
    model_size: str = "small"
    workload: str = "rl"
    lengths: str | None = None  # a file of sample lengths; default: the workload's generator
    # prompts per mini-batch (rl), samples per mini-batch (sft); None: 4 (rl) or 16 (sft), with
    # the default token budget several micro-batches per rank either way
    mini_batch_size: int | None = None
    group_size: int = 4  # GRPO responses per prompt (rl)
    max_prompt_length: int = 128
    max_response_length: int = 2048
    # per micro-batch, like verl's ppo_max_token_len_per_gpu (just above the longest RL sample, as
    # verl users set it); sft: also the longest sample
    max_token_len: int = 2304
    seed: int = 0
    out_dir: str = "odc_reports"

    def __post_init__(self):
        if self.ranks < 1:
            raise ValueError(f"--ranks must be >= 1, got {self.ranks}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"--model-size must be one of {', '.join(MODEL_SIZES)}, got '{self.model_size}'")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got '{self.workload}'")
        if self.mini_batch_size is None:
            self.mini_batch_size = 4 if self.workload == "rl" else 16
        if self.mini_batch_size < 1:
            raise ValueError(f"--mini-batch-size must be >= 1, got {self.mini_batch_size}")
        if self.lengths is not None and not os.path.exists(self.lengths):
            raise ValueError(f"--lengths file not found: {self.lengths}")
        if self.workload == "rl" and self.max_prompt_length + self.max_response_length > self.max_token_len:
            raise ValueError(f"--max-token-len {self.max_token_len} is below the longest possible sample "
                             f"({self.max_prompt_length} + {self.max_response_length})")

    @property
    def samples_per_minibatch(self) -> int:
        return self.mini_batch_size * (self.group_size if self.workload == "rl" else 1)


@dataclass
class Sample:
    prompt_len: int
    response_len: int
    advantage: float
    seed: int  # the tokens are drawn from this, so every row sees the same tokens wherever it lands

    @property
    def total(self) -> int:
        return self.prompt_len + self.response_len


def _lengths(cfg: DemoConfig, step: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    n = cfg.samples_per_minibatch
    if cfg.lengths:
        # a file gives whole-sample lengths; a quarter of each (at most the prompt cap) is prompt
        file_lengths = load_lengths(cfg.lengths)
        picks = torch.randint(0, len(file_lengths), (n,), generator=g).tolist()
        cap = cfg.max_token_len if cfg.workload == "sft" else cfg.max_prompt_length + cfg.max_response_length
        totals = [min(file_lengths[i], cap) for i in picks]
        prompts = [min(cfg.max_prompt_length, max(1, t // 4)) for t in totals]
        return prompts, [max(1, t - p) for t, p in zip(totals, prompts)]
    seed = cfg.seed * 1000 + step
    if cfg.workload == "sft":
        # scaled to a CPU: chats around 1/32 of the longest sample, documents from 1/8 of it up
        sample = sft_long_context_like(n, max_length=cfg.max_token_len, chat_median=cfg.max_token_len / 32,
                                       long_min=cfg.max_token_len // 8, seed=seed)
        return sample.prompt_lens, sample.response_lens
    sample = rl_math_like(n, max_prompt_length=cfg.max_prompt_length,
                          max_response_length=cfg.max_response_length, seed=seed)
    # GRPO: the responses of one prompt share it
    return [sample.prompt_lens[i - i % cfg.group_size] for i in range(n)], sample.response_lens


def draw_minibatches(cfg: DemoConfig) -> list[list[Sample]]:
    """RL: groups of responses per prompt, group-normalized rewards as advantages. SFT: advantage 1,
    which makes the policy loss the response tokens' negative log-likelihood."""
    g = torch.Generator().manual_seed(cfg.seed)
    n = cfg.samples_per_minibatch
    batches = []
    for step in range(cfg.steps):
        prompts, responses = _lengths(cfg, step, g)
        if cfg.workload == "rl":
            rewards = torch.randint(0, 2, (n,), generator=g).float().view(-1, cfg.group_size)
            adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        else:
            adv = torch.ones(n)
        batches.append([Sample(prompts[i], responses[i], float(adv[i]), step * n + i) for i in range(n)])
    return batches


def sample_tokens(sample: Sample, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sample.seed)
    return torch.randint(0, vocab, (sample.total,), generator=g)


def policy_loss(model, samples: list[Sample], vocab: int, global_response_tokens: int, world: int):
    """-advantage * log p(response token), token-mean over the mini-batch's response tokens (verl's
    global normalization, times the data-parallel size that FSDP's mean divides out)."""
    logps = next_token_logprobs(model, [sample_tokens(s, vocab) for s in samples])
    total = sum(-s.advantage * logp[s.prompt_len - 1 :].sum() for s, logp in zip(samples, logps))
    return total / global_response_tokens * world


def calibration_lengths(cfg: DemoConfig) -> list[int]:
    lengths, s = [], 64
    while s <= cfg.max_token_len:
        lengths.append(s)
        s *= 2
    return lengths


def calibrate_body(rank, world, cfg: DemoConfig) -> list[list[float]]:
    """Forward+backward seconds of one sequence per length, on every rank at once (as in training,
    the ranks share the machine), on an unsharded copy of the model: compute only."""
    model = build_qwen2(cfg.model_size, seed=cfg.seed)
    vocab = MODEL_SIZES[cfg.model_size].vocab_size
    points = []
    for length in calibration_lengths(cfg):
        sample = Sample(1, length - 1, 1.0, length)
        times = []
        for _ in range(4):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            policy_loss(model, [sample], vocab, length, 1).backward()
            times.append(time.perf_counter() - start)
        points.append([length, statistics.median(times[1:])])
    return points


def calibrate(cfg: DemoConfig) -> tuple[FitCost, list[list[float]]]:
    per_rank = run_ranks(calibrate_body, cfg.ranks, cfg)
    points = [[p[0][0], statistics.fmean(q[1] for q in p)] for p in zip(*per_rank)]
    a, b = fit_quadratic([p[0] for p in points], [p[1] for p in points])
    return FitCost(a, b), points


def plan_minibatches(cfg: DemoConfig, batches, cost: FitCost) -> dict:
    """Per row, per mini-batch, per rank: micro-batches of sample indices."""
    plans = {"lb_micro": [], "lb_mini": []}
    for batch in batches:
        totals = [s.total for s in batch]
        plans["lb_micro"].append(lb_micro(totals, cfg.ranks, cfg.max_token_len))
        plans["lb_mini"].append(lb_mini(totals, cfg.ranks, cfg.max_token_len, cost=cost))
    return {row: plans[plan_of(row)] for row in ROWS}


def rank_body(rank, world, cfg: DemoConfig, batches, plans):
    mesh = init_device_mesh("cpu", (world,))
    vocab = MODEL_SIZES[cfg.model_size].vocab_size
    rows = build_rows(lambda: shard_qwen2(build_qwen2(cfg.model_size, seed=cfg.seed), mesh), "shm", lr=1e-5)
    record = {row: [] for row in ROWS}
    for row in ROWS:  # warm-up, untimed: every row trains the first mini-batch once more, on one plan
        train_minibatch(rows[row], [lambda m=rows[row].model: policy_loss(
            m, batches[0][rank::world], vocab, sum(s.response_len for s in batches[0]), world)])
    for step, batch in enumerate(batches):
        response_tokens = sum(s.response_len for s in batch)
        for row in turn_order(step):
            micro_batches = plans[row][step][rank]
            losses = [lambda mb=mb, m=rows[row].model: policy_loss(m, [batch[i] for i in mb], vocab,
                                                                    response_tokens, world)
                      for mb in micro_batches]
            rec = train_minibatch(rows[row], losses)
            rec["samples"] = [batch[i].seed for mb in micro_batches for i in mb]
            rec["tokens"] = sum(batch[i].total for mb in micro_batches for i in mb)
            record[row].append(rec)
        if rank == 0:
            times = " | ".join(f"{row} {record[row][-1]['step_s']:.2f}s" for row in ROWS)
            print(f"  mini-batch {step + 1}/{len(batches)}: {times}", flush=True)
    return {"record": record, "max_param_diff": final_param_diff(rows)}


def predict(cfg: DemoConfig, batches, plans, cost: FitCost) -> dict[str, list[float]]:
    """The planner's compute-only step time of every row and mini-batch: lockstep rows last the sum over
    micro-batch steps of the slowest rank, ODC rows the slowest rank's sum. It has no transport in it,
    so it predicts the same time for the first two rows."""
    return {row: [simulate_minibatch(plans[row][k], cost.costs([s.total for s in batch]),
                                     lockstep=not row.startswith("odc")).seconds
                  for k, batch in enumerate(batches)]
            for row in ROWS}


def summarize(cfg: DemoConfig, batches, per_rank, predicted, calibration) -> dict:
    steps = range(cfg.steps)
    tokens = [sum(s.total for s in b) for b in batches]
    runs, step_s = {}, {}
    for row in ROWS:
        records = [[r["record"][row][k] for r in per_rank] for k in steps]
        step_s[row] = [max(rec["step_s"] for rec in recs) for recs in records]  # the slowest rank's
        parts = [step_breakdown(recs) for recs in records]  # [step][rank]
        fractions = {part: [sum(p[rank][f"{part}_s"] for p in parts) / sum(step_s[row]) for rank in range(cfg.ranks)]
                     for part in ("compute", "comm", "wait")}
        runs[row] = {
            "median_step_s": statistics.median(step_s[row]),
            "step_s": step_s[row],
            "tokens_per_s": sum(tokens) / sum(step_s[row]),
            "fraction_per_rank": fractions,
            "breakdown": [[{k: v for k, v in p.items() if k != "barriers"} for p in step] for step in parts],
            "barriers_per_rank": [[p["barriers"] for p in step] for step in parts],
            "micro_batches_per_rank": [[rec["micro_batches"] for rec in recs] for recs in records],
            "tokens_per_rank": [[rec["tokens"] for rec in recs] for recs in records],
            "samples_per_rank": [[rec["samples"] for rec in recs] for recs in records],
            "predicted_step_s": predicted[row],
        }
    return {
        "config": asdict(cfg),
        "runs": runs,
        "factors": factors(step_s),
        "predicted_factors": factors(predicted),
        "calibration": calibration,
        "max_param_diff": max(r["max_param_diff"] for r in per_rank),
    }


def print_table(report: dict) -> None:
    ranks = report["config"]["ranks"]
    print(f"\n{'row':<19}{'s/step':>8}{'tokens/s':>10}{'predicted':>11}   "
          "compute / comm / wait per rank")
    for row, r in report["runs"].items():
        f = r["fraction_per_rank"]
        split = "  ".join(f"{f['compute'][k]:.2f}/{f['comm'][k]:.2f}/{f['wait'][k]:.2f}" for k in range(ranks))
        print(f"{row:<19}{r['median_step_s']:>8.3f}{r['tokens_per_s']:>10.0f}"
              f"{statistics.median(r['predicted_step_s']):>11.3f}   {split}")
    print(f"\n{'factor':<16}{'from -> to':<38}{'measured':>9}{'predicted':>11}")
    for name, (slow, fast) in FACTORS.items():
        print(f"{name:<16}{slow + ' -> ' + fast:<38}{report['factors'][name]:>8.3f}x"
              f"{report['predicted_factors'][name]:>10.3f}x")
    print(f"\nheadline, ODC+LB-Mini over the lockstep baseline on the same transport: "
          f"{report['factors']['odc+lb_mini']:.3f}x (median of per-mini-batch ratios)")
    print(f"max |parameter difference| between rows after {report['config']['steps']} mini-batches: "
          f"{report['max_param_diff']:.2e}")


def plot_breakdown(report: dict, path: str) -> None:
    """Per row a panel; per mini-batch a group of bars, one per rank, stacked compute / comm / wait."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks, steps = report["config"]["ranks"], report["config"]["steps"]
    colors = {"compute": "tab:green", "comm": "tab:blue", "wait": "tab:red"}
    fig, axes = plt.subplots(1, len(ROWS), figsize=(3.2 * len(ROWS), 3.6), sharey=True)
    width = 0.8 / ranks
    for ax, row in zip(axes, ROWS):
        r = report["runs"][row]
        for k in range(steps):
            for rank in range(ranks):
                x, bottom = k + (rank - (ranks - 1) / 2) * width, 0.0
                for part, color in colors.items():
                    value = r["breakdown"][k][rank][f"{part}_s"]
                    ax.bar(x, value, width * 0.9, bottom=bottom, color=color, label=part if k == rank == 0 else None)
                    bottom += value
            ax.hlines(r["predicted_step_s"][k], k - 0.45, k + 0.45, colors="black", linestyles="--", lw=1,
                      label="planner's prediction" if k == 0 else None)
        ax.set_title(f"{row}\nmedian {r['median_step_s']:.2f} s/step", fontsize=9)
        ax.set_xticks(range(steps), [str(k + 1) for k in range(steps)], fontsize=7)
        ax.set_xlabel(f"mini-batch (bars: ranks 0-{ranks - 1})", fontsize=8)
    axes[0].set_ylabel("seconds")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"odc-demo, {report['config']['workload']} workload: where each rank's time goes "
                 f"(ODC+LB-Mini over lockstep: {report['factors']['odc+lb_mini']:.2f}x)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(cfg: DemoConfig) -> dict:
    batches = draw_minibatches(cfg)
    print(f"odc-demo: {cfg.ranks} CPU ranks x 1 thread, model '{cfg.model_size}', {cfg.workload} workload, "
          f"{cfg.steps} mini-batches of {len(batches[0])} samples, micro-batch budget {cfg.max_token_len} tokens",
          flush=True)
    cost, calibration = calibrate(cfg)
    print(f"cost fit on this CPU: t(s) = {cost.a:.3g} s^2 + {cost.b:.3g} s seconds per sequence", flush=True)
    plans = plan_minibatches(cfg, batches, cost)
    per_rank = run_ranks(rank_body, cfg.ranks, cfg, batches, plans)
    report = summarize(cfg, batches, per_rank, predict(cfg, batches, plans, cost), calibration)
    os.makedirs(cfg.out_dir, exist_ok=True)
    json_path, png_path = os.path.join(cfg.out_dir, "odc_demo.json"), os.path.join(cfg.out_dir, "odc_demo.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    plot_breakdown(report, png_path)
    print_table(report)
    print(f"report: {json_path}\npicture: {png_path}")
    return report


def main(argv=None) -> None:
    defaults = DemoConfig(ranks=2)
    p = argparse.ArgumentParser(prog="odc-demo", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=max(2, os.cpu_count() or 2))
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--model-size", default=defaults.model_size, choices=sorted(MODEL_SIZES))
    p.add_argument("--workload", default=defaults.workload, choices=WORKLOADS)
    p.add_argument("--lengths", default=None, help="sample lengths: JSON list, text file, or file.parquet:column")
    p.add_argument("--mini-batch-size", type=int, default=None,
                   help="prompts (rl, default 4) or samples (sft, default 16) per mini-batch")
    p.add_argument("--max-token-len", type=int, default=defaults.max_token_len)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out-dir", default=defaults.out_dir)
    args = p.parse_args(argv)
    try:
        cfg = DemoConfig(ranks=args.ranks, steps=args.steps, model_size=args.model_size, workload=args.workload,
                         lengths=args.lengths, mini_batch_size=args.mini_batch_size,
                         max_token_len=args.max_token_len, seed=args.seed, out_dir=args.out_dir)
    except ValueError as e:
        p.error(str(e))
    run_demo(cfg)


if __name__ == "__main__":
    main()
