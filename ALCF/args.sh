#!/usr/bin/env bash
# Sourced by train-gpt3.sh after setup.sh and models.sh: environment variables -> the run
# name, its folders, and the Megatron-DeepSpeed flags in MEGATRON_ARGS. Writes nothing:
# pretrain_gpt.py writes the DeepSpeed config it generates into RUN_DIR (--run-dir), so
# there is one config generator (megatron/deepspeed_config.py), not a JSON copy here.

zl_check "megatron|none|deepspeed" SP_TYPE
zl_check int SPSIZE
zl_check "0|1|2|3" ZERO_STAGE
case "${SP_TYPE:-}" in
    deepspeed) zl_die "SP_TYPE=deepspeed (DeepSpeed-Ulysses sequence parallelism) is out of scope for zero-lab; use SP_TYPE=megatron (--sequence-parallel with MPSIZE > 1) or SP_TYPE=none" ;;
    megatron) [[ "${SP:-1}" == 1 ]] || zl_die "SP_TYPE=megatron and SP=$SP disagree: set one of them"; SP=1 ;;
    none) [[ "${SP:-0}" == 0 ]] || zl_die "SP_TYPE=none and SP=$SP disagree: set one of them"; SP=0 ;;
esac
(( ${SPSIZE:-1} == 1 )) || zl_die "SPSIZE=$SPSIZE: DeepSpeed-Ulysses sequence parallelism is out of scope for zero-lab; use SPSIZE=1"
# With a DeepSpeed JSON of the user's (DS_CONFIG), the ZeRO stage is the JSON's unless ZERO_STAGE is set: a
# default of ours must not contradict what the user wrote there (precision likewise, in scripts/defaults.sh).
zero_stage_set=${ZERO_STAGE:+1}
ZERO_STAGE=${ZERO_STAGE:-1}

# What both launch paths share (scripts/defaults.sh): sequence, batch (global = MICRO_BATCH x GAS x data-parallel
# size; a bad layout is refused here, before mpiexec starts any rank), length, precision (DTYPE is PRECISION's
# other name), TP/PP (MPSIZE/PPSIZE) and SP, activation checkpointing, data, optimizer, intervals.
ZL_ACCELERATOR=$ACCELERATOR ZL_WORLD=$NGPUS ZL_MODEL_VARIABLE=MODEL_SIZE_KEY zl_sp_variable=SP zl_alcf_names=1
[[ -n "${SP_TYPE:-}" ]] && zl_sp_variable=SP_TYPE
source "$REPO_ROOT/scripts/defaults.sh"
MPSIZE=$TP PPSIZE=$PP DTYPE=$PRECISION

# e.g. gpt_SP_actCkpt_GPT13B_z1_seqlen1024_mp8_pp1_sp1_nl40_hs5120_gb1_mb1 (ALCF Megatron-DeepSpeed naming)
if [[ -z "${RUN_NAME:-}" ]]; then
    # gb/mb: "ds" when DS_CONFIG's JSON gives the batch (no variable sets it)
    RUN_NAME="${MODEL_SIZE_KEY}_z${ZERO_STAGE}_seqlen${SEQ_LEN}_mp${MPSIZE}_pp${PPSIZE}_sp${SPSIZE:-1}"
    RUN_NAME+="_nl${NLAYERS}_hs${HIDDEN}_gb${GLOBAL_BATCH:-ds}_mb${MICRO_BATCH:-ds}"
    (( USE_ACTIVATION_CHECKPOINTING == 1 )) && RUN_NAME="actCkpt_${RUN_NAME}"
    [[ "$SP" == 1 ]] && RUN_NAME="SP_${RUN_NAME}"  # Megatron's sequence parallelism is on
    RUN_NAME="gpt_${RUN_NAME}"
fi
# like runs/: in the repository, wherever the script is run from
RUN_DIR=$(realpath -m "${OUTPUT_ROOT:-$REPO_ROOT/outputs}/$RUN_NAME")
RUN_USER=${USER:-$(id -un)}
LOG_FILE="$RUN_DIR/logs/${RUN_USER}-$(hostname)-nhosts${NHOSTS}-ngpu${NGPUS}-$(date +%Y-%m-%d-%H%M%S).log"
CHECKPOINT_DIR="$RUN_DIR/checkpoints"

# an error about one of these flags names the variable it came from (megatron/launch/flag_sources.py)
export ZERO_LAB_FLAG_SOURCES="--zero-stage=ZERO_STAGE $TRAINING_DEFAULT_SOURCES"
MEGATRON_ARGS=(
    "${TRAINING_DEFAULT_FLAGS[@]}"
    --save "$CHECKPOINT_DIR" --tensorboard-dir "$RUN_DIR/tensorboard"
    --deepspeed --run-dir "$RUN_DIR"
    --exit-signal-handler  # PBS's SIGTERM at walltime or preemption: save this iteration, exit 0
)
[[ -z "${DS_CONFIG:-}" || -n "$zero_stage_set" ]] && MEGATRON_ARGS+=(--zero-stage "$ZERO_STAGE")
zero_shown=$ZERO_STAGE; [[ -n "${DS_CONFIG:-}" && -z "$zero_stage_set" ]] && zero_shown="from DS_CONFIG"
batch_shown="batch from DS_CONFIG"
if [[ -n "${GLOBAL_BATCH:-}" && -n "${MICRO_BATCH:-}" ]]; then
    batch_shown="global batch $GLOBAL_BATCH = micro $MICRO_BATCH x gas $GAS x dp $DPSIZE"
elif [[ -n "${GLOBAL_BATCH:-}" ]]; then
    batch_shown="global batch $GLOBAL_BATCH, micro batch from DS_CONFIG"
fi
precision_shown=$PRECISION; [[ -n "${DS_CONFIG:-}" && -z "$precision_set" ]] && precision_shown="precision from DS_CONFIG"
echo "[args] run: $RUN_NAME | mp=$MPSIZE pp=$PPSIZE | $batch_shown | zero $zero_shown | $precision_shown"
