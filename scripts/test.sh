#!/usr/bin/env bash
# Run the test suite (sets up first; the set-up is skipped where already done).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q "$@"
