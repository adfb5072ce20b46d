#!/usr/bin/env bash
# The five ZeRO experiments with the same settings, then the comparison tables and plots.
# Environment variables and extra arguments are passed to every driver (see common.sh).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RUNS_DIR=${RUNS_DIR:-$HERE/../runs}
export RUNS_DIR
for experiment in DP Z1 Z2 Z3 Z3_OL; do
    bash "$HERE/gpt_deepspeed_$experiment.sh" "$@"
done
"${PYTHON:-python3}" "$HERE/../analysis/summarize.py" "$RUNS_DIR"
