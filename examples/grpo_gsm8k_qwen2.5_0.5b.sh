#!/usr/bin/env bash
# GRPO on GSM8K with Qwen/Qwen2.5-0.5B-Instruct: strategy fsdp2 and strategy odc with otherwise identical settings,
# then the A/B report. See examples/README.md.
#
#   bash examples/grpo_gsm8k_qwen2.5_0.5b.sh                  # both runs, then the report
#   STRATEGY=odc bash examples/grpo_gsm8k_qwen2.5_0.5b.sh     # one run
#   DRY_RUN=1 bash examples/grpo_gsm8k_qwen2.5_0.5b.sh     # print both commands and odc-plan's prediction
#   bash examples/grpo_gsm8k_qwen2.5_0.5b.sh data.max_response_length=2048   # overrides go to both runs
set -euo pipefail

DATASET=gsm8k
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
EXP=gsm8k_qwen2.5_0.5b
MAX_PROMPT=512
MAX_RESPONSE=1024
TRAIN_BATCH=256
MINI_BATCH=64
N=5
TOKENS_PER_GPU=24576
ROLLOUT_TP=1
ROLLOUT_MEM=0.6
PLAN_MODEL=Qwen2.5-0.5B  # odc-plan's preset of the model's shapes

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # with this script's arguments: hydra overrides for both runs
