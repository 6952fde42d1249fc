#!/usr/bin/env bash
# GRPO on MATH with Qwen/Qwen3-8B thinking, responses up to 16k tokens: verl's fixed micro-batch batching
# (run_qwen2-7b_math.sh's) at a long-CoT length, where lockstep waits at every micro-batch for the longest
# response any GPU holds and ODC's gain is largest. 256 prompts x 8 responses per step, mini-batches of 32
# prompts (32 samples per GPU), micro-batches of 2 samples per GPU. Strategy fsdp2 and strategy odc, then
# the A/B report. See examples/README.md.
#
#   bash examples/grpo_math_qwen3_8b_long.sh                  # both runs, then the report
#   DRY_RUN=1 bash examples/grpo_math_qwen3_8b_long.sh        # print both commands and odc-plan's prediction
#   bash examples/grpo_math_qwen3_8b_long.sh actor_rollout_ref.actor.use_dynamic_bsz=True \
#       actor_rollout_ref.actor.ppo_max_token_len_per_gpu=34816   # dynamic batch size instead, in both runs
set -euo pipefail

DATASET=math
MODEL=${MODEL:-Qwen/Qwen3-8B}
EXP=math_qwen3_8b_long
MAX_PROMPT=1024
MAX_RESPONSE=16384
TRAIN_BATCH=256
MINI_BATCH=32
N=8
MICRO_BATCH=2
ROLLOUT_TP=2
ROLLOUT_MEM=0.7
PLAN_MODEL=Qwen3-8B  # odc-plan's preset of the model's shapes
SCRIPT_ARGS=("actor_rollout_ref.ref.fsdp_config.param_offload=True")

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # with this script's arguments: hydra overrides for both runs
