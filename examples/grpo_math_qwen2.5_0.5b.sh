#!/usr/bin/env bash
# GRPO on MATH with Qwen/Qwen2.5-0.5B-Instruct: strategy fsdp2 and strategy odc with otherwise identical settings,
# then the A/B report. See examples/README.md.
#
#   bash examples/grpo_math_qwen2.5_0.5b.sh                  # both runs, then the report
#   STRATEGY=odc bash examples/grpo_math_qwen2.5_0.5b.sh     # one run
set -euo pipefail

DATASET=math
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
EXP=math_qwen2.5_0.5b
MAX_PROMPT=1024
MAX_RESPONSE=3072
TRAIN_BATCH=256
MINI_BATCH=64
N=5
TOKENS_PER_GPU=24576
ROLLOUT_TP=1
ROLLOUT_MEM=0.6

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
