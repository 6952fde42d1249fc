# Shared by the grpo_*.sh scripts (source it after setting the run's settings; do not run it alone).
#
# Runs verl's GRPO trainer (python -m verl.trainer.main_ppo) once per strategy in $STRATEGY with the
# same settings; only the strategy lines differ. Each run writes its per-step metrics with verl's
# `file` logger to $OUT_DIR/$EXP/<strategy>.jsonl and its console output to <strategy>.log; after both
# the A/B report (ab_report.py) compares them.
#
# Set by the calling script: DATASET, MODEL, EXP, MAX_PROMPT, MAX_RESPONSE, TRAIN_BATCH, MINI_BATCH,
# N (responses per prompt), ROLLOUT_TP, ROLLOUT_MEM, PLAN_MODEL (the odc-plan preset of MODEL's shapes,
# used when MODEL is not a local directory), and either TOKENS_PER_GPU (dynamic batch size:
# ppo_max_token_len_per_gpu) or MICRO_BATCH (fixed micro-batches: ppo_micro_batch_size_per_gpu);
# optionally TRAIN_FILES / VAL_FILES (arrays of parquet files; default the dataset's) and SCRIPT_ARGS
# (an array of the script's own overrides).
# Arguments after the script's name go to both runs as hydra overrides, last, as in verl's scripts.
# Environment (all optional):
#   STRATEGY        "fsdp2", "odc" or "fsdp2 odc" (default: both, one after the other)
#   NGPUS, NNODES   GPUs per node (8) and nodes (1); with NNODES > 1 both runs shard inside each node
#                   (fsdp_size = NGPUS, HSDP across nodes), the only multi-node layout odc runs
#   STEPS           training steps per run (30)
#   DATA_DIR        where preprocess_data.py wrote train.parquet/test.parquet ($HOME/data/$DATASET)
#   OUT_DIR         where the runs go ($PWD/odc_ab_runs)
#   ODC_CONFIGS     hydra search path entry of the plugin's configs (pkg://odc_plugin.configs)
#   ODC_TRANSPORT, ODC_BALANCER   ODC options (auto, lb_mini)
#   ODC_COST_MODEL  LB-Mini's cost model; unset: the plugin's default (auto)
#   WANDB=1         also log to Weights & Biases (verl's wandb logger; project odc_ab, one run per strategy)
#   EXTRA_ARGS      more hydra overrides for both runs: an array set by a script that sources this one, or
#                   one override from the environment (several: give them after the script's name)
#   PYTHON          interpreter (python3)
#   DRY_RUN=1       print each run's command, one argument per line, then odc-plan's prediction for these
#                   settings; run nothing

USER_ARGS=("$@")
STRATEGY=${STRATEGY:-fsdp2 odc}
NGPUS=${NGPUS:-8}
NNODES=${NNODES:-1}
STEPS=${STEPS:-30}
DATA_DIR=${DATA_DIR:-$HOME/data/$DATASET}
OUT_DIR=${OUT_DIR:-$PWD/odc_ab_runs}
ODC_CONFIGS=${ODC_CONFIGS:-pkg://odc_plugin.configs}
ODC_TRANSPORT=${ODC_TRANSPORT:-auto}
ODC_BALANCER=${ODC_BALANCER:-lb_mini}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Settings checked before anything runs: a bad one would otherwise fail only after the first run.
for setting in STEPS NGPUS NNODES; do
    if ! [[ ${!setting} =~ ^[0-9]+$ ]] || (( 10#${!setting} < 1 )); then
        echo "$setting must be an integer >= 1; got '${!setting}'" >&2
        exit 2
    fi
done
for strategy in $STRATEGY; do
    if [[ $strategy != fsdp2 && $strategy != odc ]]; then
        echo "STRATEGY must be fsdp2, odc or \"fsdp2 odc\"; got '$STRATEGY'" >&2
        exit 2
    fi
done
RUN_DIR=$OUT_DIR/$EXP
if [[ -z ${TRAIN_FILES+set} ]]; then TRAIN_FILES=("$DATA_DIR/train.parquet"); fi
if [[ -z ${VAL_FILES+set} ]]; then VAL_FILES=("$DATA_DIR/test.parquet"); fi

hydra_list() {  # a hydra list of quoted strings: ['a', 'b']
    local out="" item
    for item in "$@"; do out+="${out:+, }'$item'"; done
    printf '[%s]' "$out"
}

LOGGER="console,file"
if [[ "${WANDB:-0}" == 1 ]]; then LOGGER+=",wandb"; fi

# Everything both runs share.
COMMON_ARGS=(
    "algorithm.adv_estimator=grpo"
    "algorithm.use_kl_in_reward=False"
    "data.train_files=$(hydra_list "${TRAIN_FILES[@]}")"
    "data.val_files=$(hydra_list "${VAL_FILES[@]}")"
    "data.train_batch_size=$TRAIN_BATCH"
    "data.max_prompt_length=$MAX_PROMPT"
    "data.max_response_length=$MAX_RESPONSE"
    "data.filter_overlong_prompts=True"
    "data.truncation=error"
    "actor_rollout_ref.model.path=$MODEL"
    "actor_rollout_ref.model.use_remove_padding=True"
    "actor_rollout_ref.model.enable_gradient_checkpointing=True"
    "actor_rollout_ref.actor.optim.lr=1e-6"
    "actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH"
    "actor_rollout_ref.actor.use_kl_loss=True"
    "actor_rollout_ref.actor.kl_loss_coef=0.001"
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl"
    "actor_rollout_ref.actor.entropy_coeff=0"
    "actor_rollout_ref.actor.fsdp_config.param_offload=False"
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False"
    "actor_rollout_ref.rollout.name=vllm"
    "actor_rollout_ref.rollout.n=$N"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_MEM"
    "trainer.logger=[$LOGGER]"
    "trainer.project_name=odc_ab"
    "trainer.n_gpus_per_node=$NGPUS"
    "trainer.nnodes=$NNODES"
    "trainer.total_training_steps=$STEPS"
    "trainer.val_before_train=False"
    "trainer.test_freq=-1"
    "trainer.save_freq=-1"
    "trainer.resume_mode=disable"
    "trainer.critic_warmup=0"
)
if [[ -n ${MICRO_BATCH:-} ]]; then
    COMMON_ARGS+=(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH"
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH"
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH"
    )
else
    COMMON_ARGS+=(
        "actor_rollout_ref.actor.use_dynamic_bsz=True"
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOKENS_PER_GPU"
    )
fi
if (( NNODES > 1 )); then
    # shards inside each node, replicas across nodes (HSDP), for both runs: odc gets and accumulates over
    # NVLink and all-reduces across nodes once per mini-batch; sharding across nodes it refuses
    COMMON_ARGS+=(
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=$NGPUS"
        "actor_rollout_ref.ref.fsdp_config.fsdp_size=$NGPUS"
    )
fi
COMMON_ARGS+=("${SCRIPT_ARGS[@]+"${SCRIPT_ARGS[@]}"}")

strategy_args() {
    case "$1" in
        fsdp2)
            STRATEGY_ARGS=(
                "actor_rollout_ref.actor.strategy=fsdp2"
                "critic.strategy=fsdp2"
            ) ;;
        odc)
            # model_engine=odc: actor, reference model and critic on strategy odc with ODC engine configs
            STRATEGY_ARGS=(
                "hydra.searchpath=[$ODC_CONFIGS]"
                "model_engine=odc"
                "actor_rollout_ref.actor.fsdp_config.odc_transport=$ODC_TRANSPORT"
                "actor_rollout_ref.actor.fsdp_config.odc_balancer=$ODC_BALANCER"
                "actor_rollout_ref.ref.fsdp_config.odc_transport=$ODC_TRANSPORT"
            )
            if [[ -n ${ODC_COST_MODEL:-} ]]; then
                STRATEGY_ARGS+=("actor_rollout_ref.actor.fsdp_config.odc_cost_model=$ODC_COST_MODEL")
            fi ;;
    esac
}

run_one() {
    local strategy=$1
    strategy_args "$strategy"
    local metrics=$RUN_DIR/$strategy.jsonl
    local cmd=(
        "$PYTHON" -m verl.trainer.main_ppo
        "${COMMON_ARGS[@]}"
        "${STRATEGY_ARGS[@]}"
        "trainer.experiment_name=${EXP}_${strategy}"
        # verl's file logger writes where VERL_FILE_LOGGER_PATH says; it runs inside a Ray actor, so the
        # variable is passed through Ray's runtime env as well as exported
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=$metrics"
        "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"
        "${USER_ARGS[@]+"${USER_ARGS[@]}"}"
    )
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%s\n' "${cmd[@]}"
        return
    fi
    mkdir -p "$RUN_DIR"
    echo "== $EXP: strategy $strategy -> $metrics"
    VERL_FILE_LOGGER_PATH=$metrics "${cmd[@]}" 2>&1 | tee "$RUN_DIR/$strategy.log"
}

plan() {
    # odc-plan for these settings: the script's model (its config.json when MODEL is a local directory, else
    # the preset of its shapes) and batching; the prompts of the first train file counted with the model's
    # tokenizer when both are here, else the rl profile's; responses drawn up to MAX_RESPONSE
    local args=(--minibatch-sizes $((MINI_BATCH * N)) --max-prompt-length "$MAX_PROMPT" --max-response-length "$MAX_RESPONSE")
    if (( NNODES > 1 )); then args+=(--nodes "$NNODES" --gpus-per-node "$NGPUS"); else args+=(--ranks "$NGPUS"); fi
    if [[ -n ${MICRO_BATCH:-} ]]; then args+=(--micro-batch-size "$MICRO_BATCH"); else args+=(--max-token-len "$TOKENS_PER_GPU"); fi
    if [[ -f $MODEL/config.json ]]; then
        args+=(--model "$MODEL")
        if [[ -f ${TRAIN_FILES[0]} ]]; then args+=(--lengths "${TRAIN_FILES[0]}:prompt" --tokenizer "$MODEL"); fi
    else
        args+=(--model "$PLAN_MODEL")
    fi
    echo "# odc-plan ${args[*]}"
    local override batching=()
    for override in "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}" "${USER_ARGS[@]+"${USER_ARGS[@]}"}"; do
        if [[ $override =~ (use_dynamic_bsz|micro_batch_size|max_token_len|mini_batch_size|train_batch_size|rollout\.n|max_prompt_length|max_response_length|n_gpus_per_node|nnodes)= ]]; then
            batching+=("$override")
        fi
    done
    if (( ${#batching[@]} )); then
        echo "# note: the plan assumes the script's own batching, not these overrides: ${batching[*]}"
    fi
    "$PYTHON" -m odc_plugin.balance.planner "${args[@]}"
}

for strategy in $STRATEGY; do
    run_one "$strategy"
done

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    plan
elif [[ -f "$RUN_DIR/fsdp2.jsonl" && -f "$RUN_DIR/odc.jsonl" ]]; then
    "$PYTHON" "$HERE/ab_report.py" "$RUN_DIR" | tee "$RUN_DIR/report.txt"
fi
