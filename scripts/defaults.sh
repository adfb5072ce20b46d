# The training settings both launch paths share, examples_zero/common.sh and ALCF/args.sh (sourced by them, never
# run): every variable below is checked once (one line naming it, its value and what is expected), given one
# default by one rule, and turned into the pretrain_gpt.py flags both paths pass, TRAINING_DEFAULT_FLAGS, with
# TRAINING_DEFAULT_SOURCES naming the variable behind each flag. docs/environment.md lists them all.
# The caller sets first:
#   ZL_ACCELERATOR  cuda or cpu: the defaults follow it (a CPU run is a few minutes on CPU ranks)
#   ZL_WORLD        every rank of the job (all hosts)
#   MODEL_SIZE      the preset (megatron/model/presets.py), and ZL_MODEL_VARIABLE, the variable it came from
# and reads back, besides the flags: SEQ_LEN, MICRO_BATCH, GAS, GLOBAL_BATCH, DPSIZE, TP, PP, SP, PRECISION,
# USE_ACTIVATION_CHECKPOINTING, LOG_INTERVAL, EVAL_INTERVAL, EVAL_ITERS, SAVE_INTERVAL.

ZERO_LAB_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# -- 1. each variable as the user gave it (before any default or arithmetic reads it)
zl_check int SEQ_LEN MICRO_BATCH GLOBAL_BATCH GAS TP PP MPSIZE PPSIZE TRAIN_ITERS LOG_INTERVAL EVAL_INTERVAL \
    SAVE_INTERVAL OMP_NUM_THREADS
zl_check port MASTER_PORT
zl_check count EVAL_ITERS SEED MAX_RESTARTS
zl_check number LR MIN_LR WEIGHT_DECAY CLIP_GRAD TRAIN_EPOCHS DISTRIBUTED_TIMEOUT_MINUTES
zl_check fraction LR_WARMUP_FRACTION LR_WARMUP_FRAC ADAM_BETA1 ADAM_BETA2
zl_check flag SP USE_ACTIVATION_CHECKPOINTING FRESH DRY_RUN
zl_check "fp32|bf16|fp16" PRECISION DTYPE
zl_check "cosine|linear|constant" LR_DECAY_STYLE
[[ -z "${DS_CONFIG:-}" || -f "$DS_CONFIG" ]] || zl_die "DS_CONFIG=$DS_CONFIG: no such file (expected a DeepSpeed JSON)"
for zl_var in SPLIT DATA_SPLIT; do
    [[ -z "${!zl_var:-}" || "${!zl_var}" =~ ^[0-9.]+(,[0-9.]+){0,2}$ ]] \
        || zl_die "$zl_var=${!zl_var}: expected up to three comma-separated weights, e.g. 969,30,1"
done

# -- 2. one name or the other (Megatron's and ALCF's names for the same setting): both given must agree; a
# message about the flag names the one given, else the path's own (zl_alcf_names=1: ALCF's, the second)
zl_given() {
    if [[ -n "${!1:-}" ]]; then echo "$1"
    elif [[ -n "${!2:-}" || -n "${zl_alcf_names:-}" ]]; then echo "$2"
    else echo "$1"; fi
}
zl_tp_name=$(zl_given TP MPSIZE) zl_pp_name=$(zl_given PP PPSIZE) zl_precision_name=$(zl_given PRECISION DTYPE)
zl_split_name=$(zl_given SPLIT DATA_SPLIT) zl_warmup_name=$(zl_given LR_WARMUP_FRACTION LR_WARMUP_FRAC)
zl_alias() {  # zl_alias NAME OTHER: NAME takes OTHER's value when only OTHER is set
    local name=$1 other=$2
    if [[ -n "${!name:-}" && -n "${!other:-}" && "${!name}" != "${!other}" ]]; then
        zl_die "$name=${!name} and $other=${!other} name the same setting: set one of them"
    fi
    [[ -n "${!name:-}" ]] || printf -v "$name" '%s' "${!other:-}"
}
zl_alias TP MPSIZE; zl_alias PP PPSIZE; zl_alias PRECISION DTYPE; zl_alias SPLIT DATA_SPLIT
zl_alias LR_WARMUP_FRACTION LR_WARMUP_FRAC
TP=${TP:-1}; PP=${PP:-1}; SP=${SP:-0}

# -- 3. defaults: a CPU run is the tiny preset's few minutes; a GPU run is GPT-2 125M at seq 1024 in bf16
precision_set=${PRECISION:+1}  # with DS_CONFIG, an unset PRECISION leaves the precision to the JSON
if [[ "$ZL_ACCELERATOR" == cuda ]]; then
    SEQ_LEN=${SEQ_LEN:-1024}; MICRO_BATCH_DEFAULT=8; PRECISION=${PRECISION:-bf16}
else
    SEQ_LEN=${SEQ_LEN:-128}; MICRO_BATCH_DEFAULT=4; PRECISION=${PRECISION:-fp32}
    [[ "$PRECISION" != fp16 ]] \
        || zl_die "PRECISION=fp16: DeepSpeed's CPU accelerator has no fp16; expected fp32 or bf16 without a GPU"
fi
if [[ -n "${TRAIN_ITERS:-}" && -n "${TRAIN_EPOCHS:-}" ]]; then
    zl_die "TRAIN_ITERS=$TRAIN_ITERS and TRAIN_EPOCHS=$TRAIN_EPOCHS both set the run's length: set one of them"
fi
if [[ -z "${TRAIN_ITERS:-}${TRAIN_EPOCHS:-}" ]]; then  # one pass over dolly on GPUs, 60 iterations on CPU ranks
    if [[ "$ZL_ACCELERATOR" == cuda ]]; then TRAIN_EPOCHS=1; else TRAIN_ITERS=60; fi
fi
USE_ACTIVATION_CHECKPOINTING=${USE_ACTIVATION_CHECKPOINTING:-0}
LOG_INTERVAL=${LOG_INTERVAL:-5}; EVAL_INTERVAL=${EVAL_INTERVAL:-50}; EVAL_ITERS=${EVAL_ITERS:-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}  # and at the end, and on SIGTERM (docs/checkpoints.md)

# The batch: MICRO_BATCH per rank, GAS micro-batches per step, global = MICRO_BATCH x GAS x data-parallel size
# (Megatron's rule; a DeepSpeed JSON of the user's gives what no variable sets: docs/bad-input.md).
zl_json_keys=""
if [[ -n "${DS_CONFIG:-}" ]]; then
    # its optimizer or scheduler section would be replaced by the flags: refused here, before the lock and the
    # resume rule act (pretrain_gpt.py refuses it too, for a JSON passed to it directly)
    zl_json_refusal=$("$PYTHON" -c 'import json, sys
from megatron.deepspeed_json import DeepSpeedJSONError, refuse_unused_sections
try:
    config = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit()  # unreadable: said below
try:
    refuse_unused_sections(config if isinstance(config, dict) else {}, sys.argv[1])
except DeepSpeedJSONError as error:
    print(str(error).split(": ", 1)[1])' "$DS_CONFIG") || zl_die "DS_CONFIG=$DS_CONFIG: $PYTHON cannot check it"
    [[ -z "$zl_json_refusal" ]] || zl_die "DS_CONFIG=$DS_CONFIG: $zl_json_refusal"
    zl_json_keys=$("$PYTHON" -c 'import json, sys
config = json.load(open(sys.argv[1]))
keys = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping")
print(*(key for key in keys if key in config),
      *(f"{key}.enabled" for key in ("bf16", "fp16") if (config.get(key) or {}).get("enabled") is True))' "$DS_CONFIG" \
        2>/dev/null) || zl_die "DS_CONFIG=$DS_CONFIG: not a readable JSON object"
fi
zl_json_gives() { [[ " $zl_json_keys " == *" $1 "* ]]; }
# fp32 has no flag of its own: a JSON that turns on bf16 or fp16 would win over PRECISION=fp32 silently
if [[ -n "$precision_set" && "$PRECISION" == fp32 ]]; then
    for zl_key in bf16.enabled fp16.enabled; do
        ! zl_json_gives "$zl_key" \
            || zl_die "$zl_precision_name=fp32 disagrees with $zl_key true in DS_CONFIG=$DS_CONFIG: drop one of them" \
                      "or make them agree"
    done
fi
if [[ -n "${GAS:-}" && -z "${MICRO_BATCH:-}" ]] && zl_json_gives train_micro_batch_size_per_gpu; then
    zl_die "GAS=$GAS: DS_CONFIG=$DS_CONFIG gives the micro batch, so set gradient_accumulation_steps there (or" \
           "MICRO_BATCH here too)"
fi
batch_flags=()
if [[ -n "${MICRO_BATCH:-}" ]] || ! zl_json_gives train_micro_batch_size_per_gpu; then
    MICRO_BATCH=${MICRO_BATCH:-$MICRO_BATCH_DEFAULT}
    batch_flags+=(--micro-batch-size "$MICRO_BATCH")
fi
if [[ -n "${GLOBAL_BATCH:-}" || -n "${GAS:-}" ]] \
        || ! { zl_json_gives train_batch_size || zl_json_gives gradient_accumulation_steps \
               || zl_json_gives train_micro_batch_size_per_gpu; }; then
    GAS=${GAS:-1}
    if [[ -n "${MICRO_BATCH:-}" ]]; then  # refused here, in one line, before any rank starts
        read -r DPSIZE zl_global zl_accumulation < <(ZERO_LAB_FLAG_SOURCES="--micro-batch-size=MICRO_BATCH
            --global-batch-size=GLOBAL_BATCH --tensor-model-parallel-size=$zl_tp_name
            --pipeline-model-parallel-size=$zl_pp_name" "$PYTHON" -m megatron.layout_check --world-size "$ZL_WORLD" \
            --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --micro-batch-size "$MICRO_BATCH" \
            ${GLOBAL_BATCH:+--global-batch-size "$GLOBAL_BATCH"}) && [[ -n "${zl_accumulation:-}" ]] || exit 1
        if [[ -n "${GLOBAL_BATCH:-}" ]]; then
            [[ "${GAS}" == 1 || "$GAS" == "$zl_accumulation" ]] || zl_die "GLOBAL_BATCH=$GLOBAL_BATCH and" \
                "GAS=$GAS disagree: MICRO_BATCH $MICRO_BATCH x data-parallel size $DPSIZE x GAS $GAS is" \
                "$(( MICRO_BATCH * DPSIZE * GAS )): set one of them"
            GAS=$zl_accumulation
        else
            GLOBAL_BATCH=$(( zl_global * GAS ))
        fi
        batch_flags+=(--global-batch-size "$GLOBAL_BATCH")
    else  # GLOBAL_BATCH with the JSON's micro batch: pretrain_gpt.py checks the two against the layout
        batch_flags+=(--global-batch-size "$GLOBAL_BATCH")
    fi
fi

# GPT-3 paper (Brown et al. 2020, Table 2.1): peak learning rate by model size, decayed to a tenth; the
# sizes it has no row for take the nearest smaller row's (tiny: 125M's)
declare -A ZL_GPT3_LR=([tiny]=6.0e-4 [125M]=6.0e-4 [355M]=3.0e-4 [760M]=2.5e-4 [774M]=2.5e-4 [1.3B]=2.0e-4
    [1.5B]=2.0e-4 [2.7B]=1.6e-4 [6.7B]=1.2e-4 [13B]=1.0e-4 [25B]=1.0e-4 [175B]=0.6e-4)
zl_size_lr=${ZL_GPT3_LR[$MODEL_SIZE]:-6.0e-4}
LR=${LR:-$zl_size_lr}
MIN_LR=${MIN_LR:-$(awk -v lr="$zl_size_lr" 'BEGIN { printf "%.2e", lr / 10 }')}

DATA_DIR=${DATA_DIR:-$ZERO_LAB_ROOT/data}
DATA_PATH=${DATA_PATH:-$DATA_DIR/dolly_text_document}  # one prefix, or "weight prefix weight prefix ..."
VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$DATA_DIR/gpt2-merges.txt}
SPLIT=${SPLIT:-969,30,1}
# GPT-3 paper optimizer: cosine decay after 1% warm-up, AdamW betas (0.9, 0.95), weight decay 0.1, gradients
# clipped at norm 1.
LR_DECAY_STYLE=${LR_DECAY_STYLE:-cosine}
LR_WARMUP_FRACTION=${LR_WARMUP_FRACTION:-0.01}
ADAM_BETA1=${ADAM_BETA1:-0.9}
ADAM_BETA2=${ADAM_BETA2:-0.95}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.1}
SEED=${SEED:-1234}
# a collective that waits longer than this ends the run (a lost host) instead of hanging; Megatron's default
DISTRIBUTED_TIMEOUT_MINUTES=${DISTRIBUTED_TIMEOUT_MINUTES:-10}
clip_flags=()
if [[ -n "${CLIP_GRAD:-}" ]] || ! zl_json_gives gradient_clipping; then
    CLIP_GRAD=${CLIP_GRAD:-1.0}; clip_flags=(--clip-grad "$CLIP_GRAD")
fi

# -- 4. the flags
read -r -a DATA_PATH_WORDS <<< "$DATA_PATH"
length_flags=(--train-epochs "${TRAIN_EPOCHS:-}")
[[ -n "${TRAIN_ITERS:-}" ]] && length_flags=(--train-iters "$TRAIN_ITERS")
precision_flags=()
[[ "$PRECISION" == fp32 || ( -n "${DS_CONFIG:-}" && -z "$precision_set" ) ]] || precision_flags=("--$PRECISION")
parallel_flags=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
(( PP == 1 )) && parallel_flags+=(--no-pipeline-parallel)
[[ "$SP" == 1 ]] && parallel_flags+=(--sequence-parallel)
[[ "$USE_ACTIVATION_CHECKPOINTING" == 1 ]] && parallel_flags+=(--checkpoint-activations)
[[ -n "${DS_CONFIG:-}" ]] && parallel_flags+=(--deepspeed_config "$DS_CONFIG")
# WANDB_PROJECT: Weights & Biases too (pip install -e .[wandb]); the run is named after the run folder and keeps
# its files in it (pretrain_gpt.py's --run-dir)
wandb_flags=(); [[ -n "${WANDB_PROJECT:-}" ]] && wandb_flags=(--wandb-project "$WANDB_PROJECT")
TRAINING_DEFAULT_FLAGS=(
    --model-size "$MODEL_SIZE" --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
    "${batch_flags[@]}" "${length_flags[@]}" "${precision_flags[@]}" "${parallel_flags[@]}"
    --data-path "${DATA_PATH_WORDS[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split "$SPLIT"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style "$LR_DECAY_STYLE" --lr-warmup-fraction "$LR_WARMUP_FRACTION"
    --adam-beta1 "$ADAM_BETA1" --adam-beta2 "$ADAM_BETA2" --weight-decay "$WEIGHT_DECAY" "${clip_flags[@]}"
    --seed "$SEED" --distributed-timeout-minutes "$DISTRIBUTED_TIMEOUT_MINUTES"
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --save-interval "$SAVE_INTERVAL" "${wandb_flags[@]}"
)
# flag=VARIABLE for each flag above: an error about the flag names the variable (megatron/launch/flag_sources.py)
TRAINING_DEFAULT_SOURCES="--model-size=$ZL_MODEL_VARIABLE --seq-length=SEQ_LEN --micro-batch-size=MICRO_BATCH
    --global-batch-size=GLOBAL_BATCH --train-iters=TRAIN_ITERS --train-epochs=TRAIN_EPOCHS --bf16=$zl_precision_name
    --fp16=$zl_precision_name --tensor-model-parallel-size=$zl_tp_name --pipeline-model-parallel-size=$zl_pp_name
    --sequence-parallel=${zl_sp_variable:-SP}
    --checkpoint-activations=USE_ACTIVATION_CHECKPOINTING --deepspeed_config=DS_CONFIG
    --data-path=DATA_PATH --vocab-file=VOCAB_FILE --merge-file=MERGE_FILE --split=$zl_split_name
    --lr=LR --min-lr=MIN_LR --lr-decay-style=LR_DECAY_STYLE --lr-warmup-fraction=$zl_warmup_name
    --adam-beta1=ADAM_BETA1 --adam-beta2=ADAM_BETA2 --weight-decay=WEIGHT_DECAY --clip-grad=CLIP_GRAD --seed=SEED
    --distributed-timeout-minutes=DISTRIBUTED_TIMEOUT_MINUTES --log-interval=LOG_INTERVAL
    --eval-interval=EVAL_INTERVAL --eval-iters=EVAL_ITERS --save-interval=SAVE_INTERVAL --wandb-project=WANDB_PROJECT"
