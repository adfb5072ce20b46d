#!/usr/bin/env bash
# Sourced by train-gpt3.sh last: the mpiexec command line, printed, then run unless DRY_RUN=1.
# The script's own arguments ("$@") are appended to pretrain_gpt.py's flags.

command -v mpiexec >/dev/null 2>&1 \
    || zl_die "mpiexec not found on PATH: load the MPI module (PBS clusters) or install MPICH (apt-get install mpich)"

# PALS (Cray/HPE, ALCF) and Hydra (MPICH) take --ppn and --envall; Open MPI spells ranks per node
# -npernode and forwards only variables named with -x. Hydra's --verbose would copy every
# environment variable (tokens included) into the log, so only PALS gets it.
ALCF_MPI_VERSION=$(mpiexec --version 2>&1 || true)
if grep -qiE 'open mpi|openrte' <<< "$ALCF_MPI_VERSION"; then
    MPIEXEC=(mpiexec --verbose -n "$NGPUS" -npernode "$NGPU_PER_HOST" --hostfile "$ALCF_HOSTFILE")
    for var in PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV DS_ACCELERATOR OMP_NUM_THREADS \
        CUDA_DEVICE_MAX_CONNECTIONS IBV_FORK_SAFE MASTER_ADDR MASTER_PORT HF_HUB_OFFLINE; do
        [[ -n "${!var+set}" ]] && MPIEXEC+=(-x "$var")
    done
elif grep -q 'HYDRA' <<< "$ALCF_MPI_VERSION"; then
    MPIEXEC=(mpiexec --envall -n "$NGPUS" --ppn "$NGPU_PER_HOST" --hostfile "$ALCF_HOSTFILE")
else
    MPIEXEC=(mpiexec --verbose --envall -n "$NGPUS" --ppn "$NGPU_PER_HOST" --hostfile "$ALCF_HOSTFILE")
fi
# Shell-quoted only where needed, so the printed line reads like what a user would type.
alcf_quote() {
    local word
    for word in "$@"; do
        if [[ "$word" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then printf '%s ' "$word"; else printf '%q ' "$word"; fi
    done
}
read -r -a ALCF_EXTRA_MPIEXEC <<< "${MPIEXEC_EXTRA_ARGS:-}"  # e.g. "--cpu-bind depth -d 16" on Polaris
ALCF_COMMAND=("${MPIEXEC[@]}" "${ALCF_EXTRA_MPIEXEC[@]}" "$PYTHON" "$REPO_ROOT/pretrain_gpt.py" \
    "${MEGATRON_ARGS[@]}" "$@")

echo "[launch] $(alcf_quote "${ALCF_COMMAND[@]}")"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    echo "[launch] DRY_RUN=1: not launching"
    exit 0
fi
# One attempt (scripts/launch_common.sh): the command goes to RUN_DIR/command.txt, the ranks' output to
# LOG_FILE, mpiexec's own report to RUN_DIR/launcher.log; on failure the last line is the cause.
alcf_note="fresh start"; [[ -n "$RESUME_LOAD" ]] && alcf_note="resuming from $RESUME_LOAD"
zl_run_attempt "$RUN_DIR" "$LOG_FILE" mpiexec "$alcf_note" "${ALCF_COMMAND[@]}"
