#!/usr/bin/env bash
# verl's examples/grpo_trainer/run_qwen2-7b_math.sh as an A/B: GRPO on GSM8K + MATH with Qwen/Qwen2-7B-Instruct,
# verl's batching (1024 prompts x 5 responses per step, mini-batches of 256 prompts, fixed micro-batches of 16
# samples per GPU, reference model offloaded, vLLM TP 2), strategy fsdp2 and strategy odc, then the A/B report.
# See examples/README.md.
#
#   bash examples/grpo_math_qwen2_7b.sh                       # both runs, then the report
#   DRY_RUN=1 bash examples/grpo_math_qwen2_7b.sh             # print both commands and odc-plan's prediction
#   bash examples/grpo_math_qwen2_7b.sh data.max_response_length=4096   # overrides go to both runs
set -euo pipefail

DATASET=math
MODEL=${MODEL:-Qwen/Qwen2-7B-Instruct}
EXP=math_qwen2_7b
TRAIN_FILES=("${DATA_DIR:-$HOME/data}/gsm8k/train.parquet" "${DATA_DIR:-$HOME/data}/math/train.parquet")
VAL_FILES=("${DATA_DIR:-$HOME/data}/gsm8k/test.parquet" "${DATA_DIR:-$HOME/data}/math/test.parquet")
MAX_PROMPT=1024
MAX_RESPONSE=1024
TRAIN_BATCH=1024
MINI_BATCH=256
N=5
MICRO_BATCH=16
ROLLOUT_TP=2
ROLLOUT_MEM=0.6
PLAN_MODEL=Qwen2.5-7B  # odc-plan's preset of the model's shapes (Qwen2-7B's config.json has the same)
SCRIPT_ARGS=("actor_rollout_ref.ref.fsdp_config.param_offload=True")

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # with this script's arguments: hydra overrides for both runs
