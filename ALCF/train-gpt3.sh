#!/usr/bin/env bash
# Train a GPT-3 family model with Megatron-DeepSpeed flags through mpiexec, inside a PBS job (or on one machine).
# Everything is set by environment variables, e.g.
#   MODEL_SIZE_KEY=GPT1_5B SEQ_LEN=1024 MICRO_BATCH=1 SP_TYPE=megatron ./ALCF/train-gpt3.sh
# (see ALCF/README.md); extra arguments go to pretrain_gpt.py. DRY_RUN=1 prints the command only.
# setup.sh activates VENV_DIR; the launch planner (megatron/launch/alcf.py) does the steps of models.sh, args.sh and
# launch.sh, takes the run lock, applies the resume rule and runs the attempt (MAX_RESTARTS more).
set -euo pipefail
ALCF_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$ALCF_DIR/setup.sh"
exec bash "$ALCF_DIR/../scripts/plan.sh" alcf -- "$@"
