# Sourced (never run) by the scripts that start zero-lab's Python: scripts/plan.sh (every launch script through it),
# tools/process_databricks_gpt2.sh, bench/gpu_suite.sh, bench/chaos.sh.
#   zl_die MESSAGE...    one `error:` line on stderr, exit 1
#   zl_find_python REPO  PYTHON: the user's PYTHON, else REPO/.venv's python, else python3 on PATH; exported, with
#                        REPO first on PYTHONPATH (the launch planner checks that it has torch)
#   zl_require_torch     one line saying how to set up and activate .venv when PYTHON cannot import torch
zl_die() { echo "error: $*" >&2; exit 1; }

zl_find_python() {
    local repo=$1
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON=$repo/.venv/bin/python
        else PYTHON=$(command -v python3) \
            || zl_die "no python3 on PATH and no $repo/.venv: run 'bash scripts/setup.sh' (it makes .venv)"
        fi
    fi
    export PYTHON PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
}

zl_require_torch() {
    "$PYTHON" -c 'import torch' 2>/dev/null \
        || zl_die "PYTHON=$PYTHON cannot import torch: run 'bash scripts/setup.sh' (it makes $REPO/.venv), then" \
                  "'source $REPO/.venv/bin/activate'; or set PYTHON to a Python that has torch"
}
