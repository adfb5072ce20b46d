#!/usr/bin/env bash
# Sourced by train-gpt3.sh after setup.sh and models.sh: environment variables -> the run
# name, its folders, and the Megatron-DeepSpeed flags in MEGATRON_ARGS. Writes nothing:
# pretrain_gpt.py writes the DeepSpeed config it generates into RUN_DIR (--run-dir), so
# there is one config generator (megatron/deepspeed_config.py), not a JSON copy here.

alcf_positive_int() {
    [[ "${!1}" =~ ^[1-9][0-9]*$ ]] || zl_die "$1=${!1}: expected a positive integer"
}

SEQ_LEN=${SEQ_LEN:-1024}
MICRO_BATCH=${MICRO_BATCH:-1}
GAS=${GAS:-1}
# tensor / pipeline parallel sizes: ALCF's MPSIZE/PPSIZE, or examples_zero's TP/PP
MPSIZE=${MPSIZE:-${TP:-1}}
PPSIZE=${PPSIZE:-${PP:-1}}
SPSIZE=${SPSIZE:-1}
SP_TYPE=${SP_TYPE:-megatron}
# With a DeepSpeed JSON of the user's (DS_CONFIG), the ZeRO stage and precision are the JSON's unless
# ZERO_STAGE or DTYPE are set: a default of ours must not contradict what the user wrote there.
zero_stage_set=${ZERO_STAGE:+1} dtype_set=${DTYPE:+1}
ZERO_STAGE=${ZERO_STAGE:-1}
USE_ACTIVATION_CHECKPOINTING=${USE_ACTIVATION_CHECKPOINTING:-1}
for var in SEQ_LEN MICRO_BATCH GAS MPSIZE PPSIZE SPSIZE; do alcf_positive_int "$var"; done
[[ "$ZERO_STAGE" =~ ^[0-3]$ ]] || zl_die "ZERO_STAGE=$ZERO_STAGE: expected 0, 1, 2 or 3"
[[ "$USE_ACTIVATION_CHECKPOINTING" =~ ^[01]$ ]] || zl_die "USE_ACTIVATION_CHECKPOINTING=$USE_ACTIVATION_CHECKPOINTING: expected 0 or 1"

case "$SP_TYPE" in
    megatron | none) ;;
    deepspeed) zl_die "SP_TYPE=deepspeed (DeepSpeed-Ulysses sequence parallelism) is out of scope for zero-lab; use SP_TYPE=megatron (--sequence-parallel with MPSIZE > 1) or SP_TYPE=none" ;;
    *) zl_die "SP_TYPE=$SP_TYPE: expected megatron or none" ;;
esac
(( SPSIZE == 1 )) || zl_die "SPSIZE=$SPSIZE: DeepSpeed-Ulysses sequence parallelism is out of scope for zero-lab; use SPSIZE=1"

# The layout and batch rules live in megatron/layout_check.py (pretrain_gpt.py uses the same ones);
# asked here so that a bad layout is refused before mpiexec starts any rank.
[[ -z "${GLOBAL_BATCH:-}" ]] || alcf_positive_int GLOBAL_BATCH
# an error about one of these flags names the variable it came from (megatron/launch/flag_sources.py)
export ZERO_LAB_FLAG_SOURCES="--model-size=MODEL_SIZE_KEY --seq-length=SEQ_LEN --micro-batch-size=MICRO_BATCH
    --global-batch-size=GLOBAL_BATCH --tensor-model-parallel-size=MPSIZE --pipeline-model-parallel-size=PPSIZE
    --sequence-parallel=SP_TYPE --zero-stage=ZERO_STAGE --deepspeed_config=DS_CONFIG --train-iters=TRAIN_ITERS
    --train-epochs=TRAIN_EPOCHS --save-interval=SAVE_INTERVAL --log-interval=LOG_INTERVAL
    --eval-interval=EVAL_INTERVAL --eval-iters=EVAL_ITERS"
ALCF_LAYOUT=$("$PYTHON" -m megatron.layout_check --world-size "$NGPUS" --tensor-model-parallel-size "$MPSIZE" \
    --pipeline-model-parallel-size "$PPSIZE" --micro-batch-size "$MICRO_BATCH" \
    ${GLOBAL_BATCH:+--global-batch-size "$GLOBAL_BATCH"}) || exit 1
if [[ -n "${GLOBAL_BATCH:-}" ]]; then
    read -r DPSIZE GLOBAL_BATCH GAS <<< "$ALCF_LAYOUT"
else
    read -r DPSIZE GLOBAL_BATCH _ <<< "$ALCF_LAYOUT"
    GLOBAL_BATCH=$(( GLOBAL_BATCH * GAS ))
fi

# e.g. gpt_SP_actCkpt_GPT13B_z1_seqlen1024_mp8_pp1_sp1_nl40_hs5120_gb1_mb1 (ALCF Megatron-DeepSpeed naming)
if [[ -z "${RUN_NAME:-}" ]]; then
    RUN_NAME="${MODEL_SIZE_KEY}_z${ZERO_STAGE}_seqlen${SEQ_LEN}_mp${MPSIZE}_pp${PPSIZE}_sp${SPSIZE}"
    RUN_NAME+="_nl${NLAYERS}_hs${HIDDEN}_gb${GLOBAL_BATCH}_mb${MICRO_BATCH}"
    (( USE_ACTIVATION_CHECKPOINTING == 1 )) && RUN_NAME="actCkpt_${RUN_NAME}"
    [[ "$SP_TYPE" == megatron ]] && RUN_NAME="SP_${RUN_NAME}"
    RUN_NAME="gpt_${RUN_NAME}"
fi
RUN_DIR=$(realpath -m "${OUTPUT_ROOT:-outputs}/$RUN_NAME")
RUN_USER=${USER:-$(id -un)}
LOG_FILE="$RUN_DIR/logs/${RUN_USER}-$(hostname)-nhosts${NHOSTS}-ngpu${NGPUS}-$(date +%Y-%m-%d-%H%M%S).log"
CHECKPOINT_DIR="$RUN_DIR/checkpoints"

# ALCF's published GPT-3 recipe differs from the shared defaults in one place: half the learning rate.
LR=${LR:-3.0e-4}; MIN_LR=${MIN_LR:-3.0e-5}
source "$REPO_ROOT/scripts/defaults.sh"  # data, vocabulary, split, optimizer and schedule: TRAINING_DEFAULT_FLAGS
ZERO_LAB_FLAG_SOURCES+=" $TRAINING_DEFAULT_SOURCES"
if [[ -z "${DTYPE:-}" ]]; then
    [[ "$ACCELERATOR" == cuda ]] && DTYPE=bf16 || DTYPE=fp32
fi
[[ "$DTYPE" =~ ^(fp32|bf16|fp16)$ ]] || zl_die "DTYPE=$DTYPE: expected fp32, bf16 or fp16"
[[ -z "${DS_CONFIG:-}" || -f "$DS_CONFIG" ]] || zl_die "DS_CONFIG=$DS_CONFIG: no such file"

MEGATRON_ARGS=(
    --model-size "$MODEL_SIZE" --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --tensor-model-parallel-size "$MPSIZE" --pipeline-model-parallel-size "$PPSIZE"
    "${TRAINING_DEFAULT_FLAGS[@]}"
    --log-interval "${LOG_INTERVAL:-1}" --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
    --save "$CHECKPOINT_DIR" --save-interval "${SAVE_INTERVAL:-1000}"
    --tensorboard-dir "$RUN_DIR/tensorboard"
    --deepspeed --run-dir "$RUN_DIR"
    --exit-signal-handler  # PBS's SIGTERM at walltime or preemption: save this iteration, exit 0
)
[[ -z "${DS_CONFIG:-}" || -n "$zero_stage_set" ]] && MEGATRON_ARGS+=(--zero-stage "$ZERO_STAGE")
if [[ -n "${TRAIN_EPOCHS:-}" ]]; then
    MEGATRON_ARGS+=(--train-epochs "$TRAIN_EPOCHS")
else
    MEGATRON_ARGS+=(--train-iters "${TRAIN_ITERS:-1000}")
fi
(( PPSIZE == 1 )) && MEGATRON_ARGS+=(--no-pipeline-parallel)
# Megatron's sequence parallelism splits activations across the TP group; with MPSIZE=1 there is none.
[[ "$SP_TYPE" == megatron ]] && (( MPSIZE > 1 )) && MEGATRON_ARGS+=(--sequence-parallel)
(( USE_ACTIVATION_CHECKPOINTING == 1 )) && MEGATRON_ARGS+=(--checkpoint-activations)
[[ "$DTYPE" != fp32 && ( -z "${DS_CONFIG:-}" || -n "$dtype_set" ) ]] && MEGATRON_ARGS+=("--$DTYPE")
[[ -n "${DS_CONFIG:-}" ]] && MEGATRON_ARGS+=(--deepspeed_config "$DS_CONFIG")
zero_shown=$ZERO_STAGE; [[ -n "${DS_CONFIG:-}" && -z "$zero_stage_set" ]] && zero_shown="from DS_CONFIG"
echo "[args] run: $RUN_NAME | dp=$DPSIZE mp=$MPSIZE pp=$PPSIZE | global batch $GLOBAL_BATCH = micro $MICRO_BATCH x gas $GAS x dp $DPSIZE | zero $zero_shown | $DTYPE"
