#!/usr/bin/env bash
# Every launch script's way into the launch planner (megatron/launch/cli.py, one Python process without torch):
#   bash scripts/plan.sh driver Z1 [-- pretrain_gpt.py flags] | alcf [-- flags] | slurm [-- flags]
# with the Python scripts/find_python.sh finds (PYTHON, else the repository's .venv, else python3 on PATH); the
# planner checks that it has torch, since the ranks run it too. ALCF/setup.sh activates VENV_DIR before.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO/scripts/find_python.sh"
zl_find_python "$REPO"
exec "$PYTHON" -m megatron.launch.cli "$@"
