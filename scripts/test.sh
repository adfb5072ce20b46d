#!/usr/bin/env bash
# Run the test suite (sets up first; the set-up is skipped where already done).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu
# The venv's tools first: torch builds DeepSpeed's C++ ops with the first `ninja` on PATH, and
# a second ninja (e.g. Debian's) records the build differently and rebuilds the ops each time.
export PATH="$PWD/.venv/bin:$PATH"
# The set-up builds only the op the main job loads; the suite loads every op (offload, NVMe, pinned memory),
# so they are built here, before pytest starts, each announced in one line (about 2 min the first time, then
# a second): no test then stalls compiling one, and no test's timeout counts a build. They go to the
# environment's own folder, which the rank entry and tests/conftest.py use too.
.venv/bin/python -m megatron.deepspeed_ops build all
# Two workers (pytest-xdist): the multi-rank tests wait more than they compute (rendezvous, heartbeats,
# restarts, saves), so two at a time keep both cores busy. Each test file runs in one worker, the network
# namespace tests all in one (tests/conftest.py); TEST_WORKERS=0 runs the suite in this one process.
workers=${TEST_WORKERS:-2}
[[ "$workers" =~ ^[0-9]+$ ]] || { echo "TEST_WORKERS=$workers: expected a number of workers (0: none)" >&2; exit 2; }
exec .venv/bin/python -m pytest -q -n "$workers" "$@"
