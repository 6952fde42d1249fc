"""`odc-demo`: a real stock-FSDP2 vs ODC A/B on CPU processes, with GRPO-like mini-batches.

Both runs train the same small Qwen2-architecture model from the same weights on the same mini-batches,
alternating mini-batch by mini-batch so that machine noise hits both alike:

  (a) stock FSDP2, samples spread by verl's LB-Micro (equal counts, same micro-batch count per rank);
  (b) ODC, samples spread by LB-Mini (each rank's total work balanced, counts free).

It prints a table, writes a JSON report and a PNG of per-rank compute-vs-communication timelines.
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

from .balance import get_cost_model, lb_micro, lb_mini, load_lengths, rl_math_like
from .comm import make_transport
from .fsdp import apply_odc
from .launch import run_ranks
from .models import MODEL_SIZES, build_qwen2, next_token_logprobs, qwen2_config, shard_qwen2
from .timeline import CommClock, TimedTransport, time_fsdp_collectives

RUNS = ("fsdp2+lb_micro", "odc+lb_mini")


@dataclass
class DemoConfig:
    ranks: int = max(2, os.cpu_count() or 2)
    steps: int = 8
    model_size: str = "small"
    lengths: str | None = None  # a file of sample lengths; default: the RL math-like generator
    mini_batch_size: int = 8  # prompts per mini-batch
    group_size: int = 4  # GRPO responses per prompt
    max_prompt_length: int = 128
    max_response_length: int = 1024
    max_token_len: int = 2048  # per micro-batch, like verl's ppo_max_token_len_per_gpu
    seed: int = 0
    out_dir: str = "odc_reports"

    def __post_init__(self):
        if self.ranks < 1:
            raise ValueError(f"--ranks must be >= 1, got {self.ranks}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"--model-size must be one of {', '.join(MODEL_SIZES)}, got '{self.model_size}'")
        if self.lengths is not None and not os.path.exists(self.lengths):
            raise ValueError(f"--lengths file not found: {self.lengths}")
        if self.max_prompt_length + self.max_response_length > self.max_token_len:
            raise ValueError(f"--max-token-len {self.max_token_len} is below the longest possible sample "
                             f"({self.max_prompt_length} + {self.max_response_length})")


@dataclass
class Sample:
    prompt_len: int
    response_len: int
    advantage: float
    seed: int  # the tokens are drawn from this, so both runs see the same tokens wherever it lands

    @property
    def total(self) -> int:
        return self.prompt_len + self.response_len


def draw_minibatches(cfg: DemoConfig) -> list[list[Sample]]:
    """GRPO-like mini-batches: groups of responses per prompt, group-normalized rewards as advantages."""
    n = cfg.mini_batch_size * cfg.group_size
    g = torch.Generator().manual_seed(cfg.seed)
    file_lengths = load_lengths(cfg.lengths) if cfg.lengths else None
    batches = []
    for step in range(cfg.steps):
        if file_lengths:
            # a file gives whole-sample lengths; a quarter of each (at most the prompt cap) is prompt
            picks = torch.randint(0, len(file_lengths), (n,), generator=g).tolist()
            totals = [min(file_lengths[i], cfg.max_prompt_length + cfg.max_response_length) for i in picks]
            prompts = [min(cfg.max_prompt_length, max(1, t // 4)) for t in totals]
            responses = [max(1, t - p) for t, p in zip(totals, prompts)]
        else:
            sample = rl_math_like(n, max_prompt_length=cfg.max_prompt_length,
                                  max_response_length=cfg.max_response_length, seed=cfg.seed * 1000 + step)
            # GRPO: the responses of one prompt share it
            prompts = [sample.prompt_lens[i - i % cfg.group_size] for i in range(n)]
            responses = sample.response_lens
        rewards = torch.randint(0, 2, (n,), generator=g).float().view(-1, cfg.group_size)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        batch = [Sample(prompts[i], responses[i], float(adv[i]), step * n + i) for i in range(n)]
        batches.append(batch)
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


def rank_body(rank, world, cfg: DemoConfig, batches, plans):
    mesh = init_device_mesh("cpu", (world,))
    vocab = MODEL_SIZES[cfg.model_size].vocab_size
    clocks = {run: CommClock() for run in RUNS}
    models = {run: shard_qwen2(build_qwen2(cfg.model_size, seed=cfg.seed), mesh) for run in RUNS}
    time_fsdp_collectives(models["fsdp2+lb_micro"], clocks["fsdp2+lb_micro"])
    odc = apply_odc(models["odc+lb_mini"], TimedTransport(make_transport("shm"), clocks["odc+lb_mini"]))
    opts = {run: torch.optim.AdamW(m.parameters(), lr=1e-5) for run, m in models.items()}
    record = {run: [] for run in RUNS}
    for step, batch in enumerate(batches):
        response_tokens = sum(s.response_len for s in batch)
        order = RUNS if step % 2 == 0 else RUNS[::-1]
        for run in order:
            model, micro_batches = models[run], plans[run][step][rank]
            dist.barrier()
            start = time.perf_counter()
            clocks[run].intervals.clear()
            if run.startswith("odc"):
                odc.begin()
            for mb in micro_batches:
                policy_loss(model, [batch[i] for i in mb], vocab, response_tokens, world).backward()
            if run.startswith("odc"):
                odc.end()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[run].step()
            opts[run].zero_grad()
            dist.barrier()
            elapsed = time.perf_counter() - start
            comm = clocks[run].take(start)
            record[run].append({
                "step_s": elapsed,
                "comm_s": sum(b - a for a, b in comm),
                "comm_intervals": comm,
                "micro_batches": len(micro_batches),
                "samples": sum(len(mb) for mb in micro_batches),
                "tokens": sum(batch[i].total for mb in micro_batches for i in mb),
            })
        if rank == 0:
            a, b = (record[run][-1]["step_s"] for run in RUNS)
            print(f"  mini-batch {step + 1}/{len(batches)}: {RUNS[0]} {a:.2f}s | {RUNS[1]} {b:.2f}s", flush=True)
    final = {run: {n: p.full_tensor().detach() for n, p in m.named_parameters()} for run, m in models.items()}
    max_diff = max((final[RUNS[0]][n] - final[RUNS[1]][n]).abs().max().item() for n in final[RUNS[0]])
    return {"record": record, "max_param_diff": max_diff}


def plan_minibatches(cfg: DemoConfig, batches) -> dict:
    cost = get_cost_model("flops", model=qwen2_config(cfg.model_size))
    plans = {run: [] for run in RUNS}
    for batch in batches:
        totals = [s.total for s in batch]
        plans["fsdp2+lb_micro"].append(lb_micro(totals, cfg.ranks, cfg.max_token_len))
        plans["odc+lb_mini"].append(lb_mini(totals, cfg.ranks, cfg.max_token_len, cost=cost))
    return plans


def summarize(cfg: DemoConfig, batches, per_rank) -> dict:
    steps = range(cfg.steps)
    # A mini-batch takes as long as its slowest rank; every rank ends at the same barrier.
    step_s = {run: [max(r["record"][run][k]["step_s"] for r in per_rank) for k in steps] for run in RUNS}
    tokens = [sum(s.total for s in b) for b in batches]
    runs = {}
    for run in RUNS:
        idle = [sum(r["record"][run][k]["comm_s"] for k in steps) / sum(step_s[run]) for r in per_rank]
        runs[run] = {
            "median_step_s": statistics.median(step_s[run]),
            "step_s": step_s[run],
            "tokens_per_s": sum(tokens) / sum(step_s[run]),
            "idle_fraction_per_rank": idle,
            "micro_batches_per_rank": [[r["record"][run][k]["micro_batches"] for k in steps] for r in per_rank],
            "tokens_per_rank": [[r["record"][run][k]["tokens"] for k in steps] for r in per_rank],
        }
    ratios = [a / b for a, b in zip(step_s[RUNS[0]], step_s[RUNS[1]])]
    return {
        "config": asdict(cfg),
        "runs": runs,
        "speedup_median_of_pairs": statistics.median(ratios),
        "speedup_per_pair": ratios,
        "max_param_diff": max(r["max_param_diff"] for r in per_rank),
        "timelines": {run: [[r["record"][run][k]["comm_intervals"] for k in steps] for r in per_rank]
                      for run in RUNS},
    }


def print_table(report: dict) -> None:
    print(f"\n{'run':<18}{'median s/step':>14}{'tokens/s':>10}  idle fraction per rank")
    for run, r in report["runs"].items():
        idle = " ".join(f"{x:.2f}" for x in r["idle_fraction_per_rank"])
        print(f"{run:<18}{r['median_step_s']:>14.3f}{r['tokens_per_s']:>10.0f}  {idle}")
    print(f"\nspeedup of {RUNS[1]} over {RUNS[0]} (median of per-mini-batch ratios): "
          f"{report['speedup_median_of_pairs']:.3f}x")
    print(f"max |parameter difference| after {report['config']['steps']} mini-batches: {report['max_param_diff']:.2e}")


def plot_timelines(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(RUNS), 1, figsize=(11, 1.2 + 0.6 * report["config"]["ranks"] * len(RUNS)),
                             sharex=True)
    for ax, run in zip(axes, RUNS):
        offset = 0.0
        for k, step_s in enumerate(report["runs"][run]["step_s"]):
            for rank, intervals in enumerate(report["timelines"][run]):
                ax.broken_barh([(offset, step_s)], (rank - 0.4, 0.8), color="tab:blue")
                ax.broken_barh([(offset + a, b - a) for a, b in intervals[k]], (rank - 0.4, 0.8), color="tab:red")
            ax.axvline(offset, color="black", lw=0.5)
            offset += step_s
        ax.set_yticks(range(report["config"]["ranks"]), [f"rank {r}" for r in range(report["config"]["ranks"])])
        ax.set_title(f"{run}: compute (blue) vs communication + waiting (red)", fontsize=10)
    axes[-1].set_xlabel("seconds (mini-batches back to back)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(cfg: DemoConfig) -> dict:
    batches = draw_minibatches(cfg)
    plans = plan_minibatches(cfg, batches)
    print(f"odc-demo: {cfg.ranks} CPU ranks x 1 thread, model '{cfg.model_size}', {cfg.steps} mini-batches of "
          f"{len(batches[0])} samples, micro-batch budget {cfg.max_token_len} tokens", flush=True)
    per_rank = run_ranks(rank_body, cfg.ranks, cfg, batches, plans)
    report = summarize(cfg, batches, per_rank)
    os.makedirs(cfg.out_dir, exist_ok=True)
    json_path, png_path = os.path.join(cfg.out_dir, "odc_demo.json"), os.path.join(cfg.out_dir, "odc_demo.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    plot_timelines(report, png_path)
    print_table(report)
    print(f"report: {json_path}\ntimelines: {png_path}")
    return report


def main(argv=None) -> None:
    defaults = DemoConfig(ranks=2)
    p = argparse.ArgumentParser(prog="odc-demo", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=max(2, os.cpu_count() or 2))
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--model-size", default=defaults.model_size, choices=sorted(MODEL_SIZES))
    p.add_argument("--lengths", default=None, help="sample lengths: JSON list, text file, or file.parquet:column")
    p.add_argument("--mini-batch-size", type=int, default=defaults.mini_batch_size, help="prompts per mini-batch")
    p.add_argument("--max-token-len", type=int, default=defaults.max_token_len)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out-dir", default=defaults.out_dir)
    args = p.parse_args(argv)
    try:
        cfg = DemoConfig(ranks=args.ranks, steps=args.steps, model_size=args.model_size, lengths=args.lengths,
                         mini_batch_size=args.mini_batch_size, max_token_len=args.max_token_len, seed=args.seed,
                         out_dir=args.out_dir)
    except ValueError as e:
        p.error(str(e))
    run_demo(cfg)


if __name__ == "__main__":
    main()
