#!/usr/bin/env bash
# A two-host run full of faults that restarts itself each time (bench/chaos.py says what it does):
#   bash bench/chaos.sh --faults 10 --seed 1 [--out bench/results/chaos-seed1.md]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO/scripts/find_python.sh"  # finding Python as every launch path does
zl_find_python "$REPO"
export PATH=$(dirname "$PYTHON"):$PATH DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "$PYTHON" "$REPO/bench/chaos.py" "$@"
