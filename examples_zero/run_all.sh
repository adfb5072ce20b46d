#!/usr/bin/env bash
# The six ZeRO experiments with the same settings (stages 0-3, stage 3 with CPU offload and with NVMe
# offload), then the comparison tables, plots and report.
# Environment variables and extra arguments are passed to every driver (docs/environment.md).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RUNS_DIR=${RUNS_DIR:-$HERE/../runs}
export RUNS_DIR
source "$HERE/../scripts/find_python.sh"
zl_find_python "$(dirname "$HERE")"  # the analysis runs in the project's Python (matplotlib), as the drivers do
for experiment in DP Z1 Z2 Z3 Z3_OL Z3_NVMe; do
    bash "$HERE/gpt_deepspeed_$experiment.sh" "$@"
done
"$PYTHON" "$HERE/../analysis/summarize.py" "$RUNS_DIR"
