#!/usr/bin/env bash
# GRPO on MATH with Qwen/Qwen2.5-1.5B-Instruct: strategy fsdp2 and strategy odc with otherwise identical settings,
# then the A/B report. See examples/README.md.
#
#   bash examples/grpo_math_qwen2.5_1.5b.sh                  # both runs, then the report
#   STRATEGY=odc bash examples/grpo_math_qwen2.5_1.5b.sh     # one run
#   DRY_RUN=1 bash examples/grpo_math_qwen2.5_1.5b.sh     # print both commands and odc-plan's prediction
#   bash examples/grpo_math_qwen2.5_1.5b.sh data.max_response_length=2048   # overrides go to both runs
set -euo pipefail

DATASET=math
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
EXP=math_qwen2.5_1.5b
MAX_PROMPT=1024
MAX_RESPONSE=3072
TRAIN_BATCH=256
MINI_BATCH=64
N=5
TOKENS_PER_GPU=16384
ROLLOUT_TP=1
ROLLOUT_MEM=0.5
PLAN_MODEL=Qwen2.5-1.5B  # odc-plan's preset of the model's shapes

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # with this script's arguments: hydra overrides for both runs
