#!/usr/bin/env bash
# Set up zero-lab on a fresh machine: a virtual environment in .venv with the CPU build
# of torch, the package (which compiles the pybind11 helper), and an MPI launcher for
# the ALCF scripts. Safe to run again: every step is skipped when already done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV_DIR=${VENV_DIR:-.venv}
PYTHON=${PYTHON:-python3}

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    echo "[setup] creating virtual environment $VENV_DIR"
    "$PYTHON" -m venv "$VENV_DIR"
fi
pip_install() { "$VENV_DIR/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

# torch first and pinned: an unpinned torch requirement would pull the CUDA wheels (GBs).
if ! "$VENV_DIR/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==${TORCH_VERSION:-2.13.0}"
    pip_install "torch==${TORCH_VERSION:-2.13.0}"
fi
echo "[setup] installing zero-lab (pip install -e .[test], builds megatron.data.helpers)"
pip_install -e ".[test]"

# mpiexec is needed by ALCF/train-gpt3.sh and its tests; Debian's MPICH provides it.
if ! command -v mpiexec >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
        echo "[setup] installing mpich (mpiexec) from Debian"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mpich >/dev/null
    else
        echo "[setup] warning: no mpiexec found; install MPICH or Open MPI to use ALCF/train-gpt3.sh" >&2
    fi
fi
echo "[setup] done: activate with 'source $VENV_DIR/bin/activate'"
