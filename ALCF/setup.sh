#!/usr/bin/env bash
# Sourced by train-gpt3.sh: the Python environment every rank inherits. VENV_DIR=<virtual environment> is activated
# (its python runs the ranks unless PYTHON is set). Where the job runs (hosts from PBS_NODEFILE, else HOSTFILE, else
# this host; GPUs per host) is the launch planner's setup step (megatron/launch/alcf.py): `bash ALCF/setup.sh`
# prints what it decides.
if [[ -n "${VENV_DIR:-}" ]]; then
    [[ -f "$VENV_DIR/bin/activate" ]] \
        || { echo "error: VENV_DIR=$VENV_DIR: no bin/activate there (not a virtual environment)" >&2; exit 1; }
    # shellcheck disable=SC1091
    source "$VENV_DIR/bin/activate"
    export PYTHON=${PYTHON:-$VENV_DIR/bin/python}
fi
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # run, not sourced: show the setup step
    exec bash "$(dirname "${BASH_SOURCE[0]}")/../scripts/plan.sh" alcf --show setup
fi
