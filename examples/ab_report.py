"""A/B report of a fsdp2 run and an odc run (see examples/README.md).

    python examples/ab_report.py odc_ab_runs/gsm8k_qwen2.5_0.5b          # fsdp2.jsonl vs odc.jsonl there
    python examples/ab_report.py fsdp2.jsonl odc.jsonl [--skip-first N] [--json]

The logic lives in odc_plugin.verl.ab_report (also `python -m odc_plugin.verl.ab_report`).
"""

import sys

from odc_plugin.verl.ab_report import main

if __name__ == "__main__":
    sys.exit(main())
