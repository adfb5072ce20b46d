# Shared by every launch path: examples_zero/common.sh (and through it examples_zero/slurm/train.sbatch) and
# ALCF/train-gpt3.sh source this file (never run it). It holds what they must do alike:
#   zl_find_python REPO    PYTHON: the user's PYTHON, else REPO/.venv's python, else python3 on PATH; it must
#                          import torch. Sets ZL_CUDA_GPUS (the GPUs torch sees); REPO goes first on PYTHONPATH.
#   zl_resume_rule RUN     RESUME_LOAD: the checkpoint folder to resume (--load), empty for a fresh start, by the
#                          one resume rule (megatron/checkpointing/run_folder.py; FRESH=1 asks for a fresh start)
#   zl_run_attempt RUN LOG LAUNCHER NOTE [--node NAME] CMD...
#                          replaces the shell with megatron/launch/attempt.py running CMD: output appended to
#                          LOG, the launcher's report to RUN/launcher.log, the cause of a failure as the last line
#                          (--node NAME: a further host's launcher, its files named launcher.NAME.log and
#                          command.NAME.txt)
# ZERO_LAB_FLAG_SOURCES, set by the caller, maps Megatron flags to the variables they came from, so that an
# error names the variable to change (megatron/launch/flag_sources.py).

zl_die() { echo "error: $*" >&2; exit 1; }

zl_find_python() {
    local repo=$1
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$repo/.venv/bin/python" ]]; then
            PYTHON=$repo/.venv/bin/python
        else
            PYTHON=$(command -v python3) \
                || zl_die "no python3 on PATH and no $repo/.venv: run 'bash scripts/setup.sh' (it makes .venv)"
        fi
    fi
    ZL_CUDA_GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) \
        || zl_die "PYTHON=$PYTHON cannot import torch: run 'bash scripts/setup.sh' (it makes $repo/.venv), then" \
                  "'source $repo/.venv/bin/activate'; or set PYTHON to a Python that has torch"
    export PYTHON PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
}

zl_resume_rule() {
    [[ "${FRESH:-0}" =~ ^[01]$ ]] || zl_die "FRESH=$FRESH: expected 0 or 1 (1: start the run afresh)"
    local flags=()
    [[ "${FRESH:-0}" == 1 ]] && flags+=(--fresh)
    [[ "${DRY_RUN:-0}" == 1 ]] && flags+=(--dry-run)
    RESUME_LOAD=$("$PYTHON" -m megatron.checkpointing.run_folder "$1" "${flags[@]}") || exit 1
}

zl_run_attempt() {
    local node=()
    if [[ "${5:-}" == --node ]]; then node=(--node "$6"); set -- "${@:1:4}" "${@:7}"; fi
    exec "$PYTHON" -m megatron.launch.attempt --run-dir "$1" --log "$2" --launcher "$3" --note "$4" "${node[@]}" \
        -- "${@:5}"
}
