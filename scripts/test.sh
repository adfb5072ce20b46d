#!/usr/bin/env bash
# Run the test suite (sets up first; the set-up is skipped where already done).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu
# The venv's tools first: torch builds DeepSpeed's C++ ops with the first `ninja` on PATH, and
# a second ninja (e.g. Debian's) records the build differently and rebuilds the ops each time.
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q "$@"
