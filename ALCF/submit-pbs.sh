#!/usr/bin/env bash
#PBS -N zero-lab-gpt
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:eagle
#PBS -q debug-scaling
#PBS -j oe
# PBS job script for ALCF/train-gpt3.sh. Two ways to submit, both from the repository root:
#   qsub -V -A <project> ALCF/submit-pbs.sh       # the #PBS defaults above; -V carries this shell's variables
#   PBS_ACCOUNT=<project> NNODES=4 WALLTIME=02:00:00 QUEUE=prod FILESYSTEMS=home:eagle \
#       MODEL_SIZE_KEY=GPT1_5B ./ALCF/submit-pbs.sh   # submits itself with those resources
# Inside the job it runs train-gpt3.sh with the submitting shell's variables (qsub -V).
set -euo pipefail

if [[ -z "${PBS_JOBID:-}" ]]; then
    [[ -n "${PBS_ACCOUNT:-}" ]] || { echo "error: PBS_ACCOUNT is not set (the project to charge, qsub -A)" >&2; exit 1; }
    command -v qsub >/dev/null 2>&1 || { echo "error: qsub not found: run this on a PBS login node" >&2; exit 1; }
    ZERO_LAB_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    export ZERO_LAB_ROOT
    QSUB=(qsub -V -A "$PBS_ACCOUNT" -q "${QUEUE:-debug-scaling}" -N "${JOB_NAME:-zero-lab-gpt}"
        -l "select=${NNODES:-2}:system=${SYSTEM:-polaris}" -l place=scatter
        -l "walltime=${WALLTIME:-01:00:00}" -l "filesystems=${FILESYSTEMS:-home:eagle}"
        "$ZERO_LAB_ROOT/ALCF/submit-pbs.sh")
    echo "[submit] ${QSUB[*]}"
    exec "${QSUB[@]}"
fi

# In the job: PBS starts us in $HOME with a copy of this script, so go back to where qsub ran.
cd "${PBS_O_WORKDIR:?PBS_O_WORKDIR is not set (not started by PBS?)}"
TRAIN_SCRIPT="${ZERO_LAB_ROOT:-$PBS_O_WORKDIR}/ALCF/train-gpt3.sh"
[[ -x "$TRAIN_SCRIPT" ]] || { echo "error: $TRAIN_SCRIPT not found: submit from the zero-lab repository root" >&2; exit 1; }
exec "$TRAIN_SCRIPT" "$@"
