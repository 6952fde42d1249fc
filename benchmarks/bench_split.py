"""Splitting the longest samples (odc-demo's odc+lb_mini+split row) against ODC+LB-Mini, EMULATED.

At 16 ranks with layer compute emulated from a GPU fit (the H100 Qwen2.5-7B one by default), for the sft
and rl workloads at one sample (sft; rl: 4 responses of one prompt) per rank and at the default 8 per rank:
each case is one odc-demo run, its rows taking turns mini-batch by mini-batch, and this prints, measured in
that run, the split row's step time over ODC+LB-Mini's (median of per-mini-batch ratios), the planner's
prediction of that ratio, and the split row's step time over the limit of plans that may split (the work
over the ranks plus the all-to-alls splitting needs, or the longest sample at its best split). The
all-to-alls are modelled (odc_plugin/balance/split.py: NVLink 4 at 80%), not measured.

    python benchmarks/bench_split.py --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from odc_plugin.demo.config import DemoConfig
from odc_plugin.demo.rows import ROWS, SPLIT_ROW
from odc_plugin.demo.run import run_demo

LB_MINI = ROWS[3]


def case(workload: str, per_rank_one: bool, args) -> dict:
    # sft: samples per mini-batch; rl: prompts (4 responses each)
    mini_batch = (args.ranks if workload == "sft" else args.ranks // 4) if per_rank_one else None
    with tempfile.TemporaryDirectory() as out:
        cfg = DemoConfig(
            ranks=args.ranks,
            steps=args.steps,
            workload=workload,
            mini_batch_size=mini_batch,
            emulate=args.emulate,
            time_scale=args.time_scale,
            split=True,
            out_dir=out,
        )
        report = run_demo(cfg, quiet=True)
    split, plain = report["runs"][SPLIT_ROW], report["runs"][LB_MINI]
    limits = [lim["seconds"] for lim in report["split_limit"]]
    return {
        "case": f"{workload}, {report['samples_per_minibatch'] // args.ranks} a rank",
        "lb_mini_s": plain["median_step_s"],
        "split_s": split["median_step_s"],
        "speedup": report["factors"]["split"],
        "predicted": report["predicted_factors"]["split"],
        "over_limit": statistics.median(m / lim for m, lim in zip(split["step_s"], limits)),
        "bounds": "/".join(lim["bound"] for lim in report["split_limit"]),
        "splits": "/".join(map(str, split["splits_per_minibatch"])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed mini-batches per case")
    p.add_argument("--emulate", default="configs/cost_fit/Qwen2.5-7B-H100.json")
    p.add_argument(
        "--time-scale",
        type=lambda v: v if v == "auto" else float(v),
        default="auto",
        help="emulated seconds = the fit's times this (default auto: a rank's fair share of a mini-batch ~5 s)",
    )
    args = p.parse_args()
    rows = [case(w, one, args) for w in ("sft", "rl") for one in (True, False)]
    print(f"EMULATED layer compute from {args.emulate}, {args.ranks} ranks, {args.steps} mini-batches a case")
    print(
        f"{'case':<14}{'lb_mini s':>10}{'split s':>9}{'lb_mini/split':>15}{'predicted':>11}"
        f"{'split/limit':>13}  bound per mini-batch  split micro-batches"
    )
    for r in rows:
        print(
            f"{r['case']:<14}{r['lb_mini_s']:>10.2f}{r['split_s']:>9.2f}{r['speedup']:>14.2f}x{r['predicted']:>10.2f}x"
            f"{r['over_limit']:>12.2f}x  {r['bounds']:<20}  {r['splits']}"
        )


if __name__ == "__main__":
    main()
