#!/usr/bin/env bash
# Train a GPT-3 family model with Megatron-DeepSpeed flags through mpiexec, inside a PBS job
# (or on one machine). Everything is set by environment variables, e.g.
#   MODEL_SIZE_KEY=GPT1_5B SEQ_LEN=1024 MICRO_BATCH=1 SP_TYPE=megatron ./ALCF/train-gpt3.sh
# (see ALCF/README.md); extra arguments go to pretrain_gpt.py. DRY_RUN=1 prints the command only.
set -euo pipefail
ALCF_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(dirname "$ALCF_DIR")

source "$REPO_ROOT/scripts/launch_common.sh"  # finding Python, the resume rule, one attempt of a run
source "$ALCF_DIR/setup.sh"
source "$ALCF_DIR/models.sh"
source "$ALCF_DIR/args.sh"

# mpiexec needs a hostfile; without PBS_NODEFILE/HOSTFILE the run uses this host only.
ALCF_HOSTFILE=${alcf_hostfile_in:-$RUN_DIR/hostfile}
# One launch per run folder, on every path (scripts/launch_common.sh): a second one is refused in one line.
[[ "${DRY_RUN:-0}" == 1 ]] || zl_lock_run "$RUN_DIR"
# The one resume rule (scripts/launch_common.sh): an intact checkpoint in the run folder is resumed;
# FRESH=1 moves the run folder's old files aside and starts afresh. --load is passed always, as Megatron's
# scripts do: pretrain_gpt.py resumes what the folder holds then (rank 0 reads it for every rank), or starts
# afresh when it holds nothing.
zl_resume_rule "$RUN_DIR"
MEGATRON_ARGS+=(--load "$CHECKPOINT_DIR")
if [[ "${DRY_RUN:-0}" != 1 ]]; then
    mkdir -p "$RUN_DIR/logs"
    [[ -n "$alcf_hostfile_in" ]] || printf '%s\n' "${HOSTS[@]}" > "$ALCF_HOSTFILE"
    echo "$LOG_FILE" >> "${LOGFILES:-$REPO_ROOT/logfiles}"
    echo "[train-gpt3] log: $LOG_FILE"
    echo "[train-gpt3] follow it with: tail -f \$(tail -1 ${LOGFILES:-$REPO_ROOT/logfiles})"
fi
source "$ALCF_DIR/launch.sh" "$@"
