"""LB-Mini against verl's LB-Micro: balance efficiency, balancing time, and the planner's predictions.

1. Balance efficiency (limit / largest rank total) of LB-Mini and of verl's equal-size partition over
   random mini-batches of the RL-like and SFT-like length distributions.
2. Time to balance 4,096 samples over 64 ranks (pure Python, one core).
3. odc-plan's tables (Qwen2.5-7B FLOPs, compute only) for the RL-like distribution with the usual 4k and a
   DAPO-like 16k response cap, and for the SFT-like one.

    python benchmarks/bench_balance.py [--draws 100] [--plan-draws 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from odc_plugin.balance import (
    balance_efficiency,
    get_cost_model,
    lb_mini,
    rl_math_like,
    sft_long_context_like,
    verl_rank_partition,
)
from odc_plugin.balance.lengths import plan_lengths
from odc_plugin.balance.plan_report import format_table
from odc_plugin.balance.step_time import StepTimeModel, plan_table

GENERATORS = {"rl": (rl_math_like, 16384), "sft": (sft_long_context_like, 32768)}


def efficiency(draws: int) -> None:
    print(f"== balance efficiency over {draws} mini-batches: mean (min); verl = LB-Micro's equal-size partition")
    print(
        f"{'lengths':>7} {'cost':>6} {'ranks':>5} {'/rank':>5} | {'LB-Micro (verl)':>17} | {'LB-Mini':>17} | not worse"
    )
    for name, cost, sizes in [
        ("rl", "tokens", [(8, 4), (16, 8), (32, 4), (64, 4), (64, 16)]),
        ("rl", "flops", [(8, 4), (16, 8), (32, 4), (64, 4), (64, 16)]),
        ("sft", "flops", [(8, 4), (16, 8), (64, 4)]),
    ]:
        generate, max_token_len = GENERATORS[name]
        model = get_cost_model(cost)
        for dp, per_rank in sizes:
            micro, mini = [], []
            for seed in range(draws):
                lens = generate(dp * per_rank, seed=seed).total
                costs = model.costs(lens)
                micro.append(balance_efficiency(verl_rank_partition(lens, dp), costs))
                mini.append(balance_efficiency(lb_mini(lens, dp, max_token_len, cost=model), costs))
            never_worse = all(b >= a for a, b in zip(micro, mini))
            print(
                f"{name:>7} {cost:>6} {dp:>5} {per_rank:>5} | {statistics.fmean(micro):.4f} ({min(micro):.4f}) | "
                f"{statistics.fmean(mini):.4f} ({min(mini):.4f}) | {never_worse}"
            )


def timing(runs: int) -> None:
    print(f"\n== lb_mini on 4096 RL-like samples over 64 ranks, {runs} runs (one Python thread)")
    for cost in ("tokens", "flops"):
        times = []
        for seed in range(runs):
            lens = rl_math_like(4096, seed=seed).total
            start = time.perf_counter()
            lb_mini(lens, 64, 16384, cost=cost)
            times.append(time.perf_counter() - start)
        print(f"{cost:>6}: median {statistics.median(times) * 1e3:.0f} ms, min {min(times) * 1e3:.0f} ms")


def planner(draws: int) -> None:
    cost = get_cost_model("flops", model="Qwen2.5-7B")
    model = StepTimeModel(throughput=4e14)
    for name, options in [("rl", {}), ("rl", {"max_response_length": 16384}), ("sft", {})]:
        source = plan_lengths(name, **options)
        max_token_len = max(16384, source.longest)
        flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in options.items())
        print(
            f"\n== odc-plan --lengths {name}{flags}: Qwen2.5-7B FLOPs at 4e14 FLOP/s, compute only, "
            f"max_token_len={max_token_len}, {draws} draws; times in seconds per mini-batch"
        )
        rows = plan_table(source.draw, [8, 16, 32, 64], [256, 512, 1024], max_token_len, cost, model, draws)
        print(format_table(rows))


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--draws", type=int, default=100, help="mini-batches per efficiency row")
    p.add_argument("--timing-runs", type=int, default=7)
    p.add_argument("--plan-draws", type=int, default=5, help="mini-batches per planner row")
    args = p.parse_args()
    efficiency(args.draws)
    timing(args.timing_runs)
    planner(args.plan_draws)


if __name__ == "__main__":
    main()
