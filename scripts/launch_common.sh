# Shared by every launch path: examples_zero/common.sh (and through it examples_zero/slurm/train.sbatch) and
# ALCF/train-gpt3.sh source this file (never run it). It holds what they must do alike:
#   zl_find_python REPO    PYTHON: the user's PYTHON, else REPO/.venv's python, else python3 on PATH; it must
#                          import torch. Sets ZL_CUDA_GPUS (the GPUs torch sees); REPO goes first on PYTHONPATH.
#   zl_check KIND VAR...   each VAR that is set (not empty) must be of KIND, else one line naming it, its value and
#                          what is expected: int (> 0), count (>= 0), number (>= 0), fraction (0 to 1), flag (0 or
#                          1), port (1 to 65535), or the choices themselves, "a|b|c"
#   zl_lock_run RUN [NAME] one launch of a run at a time: takes RUN/NAME (default .zero-lab.lock) with flock, held
#                          by this shell and, through exec, the attempt supervisor until the run ends; a second
#                          launch of the same run ends in one line naming the run folder and who holds it
#   zl_resume_rule RUN     RESUME_LOAD: the checkpoint folder to resume (--load), empty for a fresh start, by the
#                          one resume rule (megatron/checkpointing/run_folder.py; FRESH=1 asks for a fresh start)
#   zl_run_attempt RUN LOG LAUNCHER NOTE [--node NAME] CMD...
#                          replaces the shell with megatron/launch/attempt.py running CMD: output appended to
#                          LOG, the launcher's report to RUN/launcher.log, the cause of a failure as the last line
#                          (--node NAME: a further host's launcher, its files named launcher.NAME.log and
#                          command.NAME.txt). With MAX_RESTARTS=N, an attempt that fails of a fault the next one
#                          can get past (megatron/launch/restart.py) starts the launch script again, at most N
#                          times: the one resume rule then resumes the newest intact checkpoint (FRESH=1 applies
#                          to the first start only); when the other hosts of a torchrun run do not come back
#                          within HOST_WAIT_SECONDS, host 0 goes on alone through --universal-checkpoint
# ZERO_LAB_FLAG_SOURCES, set by the caller, maps Megatron flags to the variables they came from, so that an
# error names the variable to change (megatron/launch/flag_sources.py).

zl_die() { echo "error: $*" >&2; exit 1; }

# the launch script and its arguments, for a restart (sourced at the script's top level, "$@" is its own)
ZL_LAUNCH_SCRIPT=$(realpath "$0")
ZL_LAUNCH_ARGS=("$@")
# 75: megatron/launch/restart.py's RESTART_STATUS, an attempt that failed of a fault worth restarting
ZL_RESTART_STATUS=75
# 76: its HOSTS_MISSING_STATUS, an attempt whose launcher gave up waiting for the other hosts (HOST_WAIT_SECONDS)
ZL_HOSTS_MISSING_STATUS=76

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

zl_check() {
    local kind=$1 var pattern expected; shift
    case "$kind" in
        int) pattern='^[1-9][0-9]*$' expected="a positive integer" ;;
        count) pattern='^[0-9]+$' expected="an integer >= 0" ;;
        number) pattern='^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$' expected="a number >= 0" ;;
        fraction) pattern='^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$' expected="a number from 0 to 1" ;;
        flag) pattern='^[01]$' expected="0 or 1" ;;
        port) pattern='^[1-9][0-9]{0,4}$' expected="a TCP port, 1 to 65535" ;;
        *) pattern="^($kind)\$" expected="one of ${kind//|/, }" ;;
    esac
    for var in "$@"; do
        [[ -n "${!var:-}" ]] || continue
        [[ "${!var}" =~ $pattern ]] && { [[ "$kind" != fraction ]] || awk -v v="${!var}" 'BEGIN { exit !(v <= 1) }'; } \
            && { [[ "$kind" != port ]] || (( ${!var} <= 65535 )); } \
            || zl_die "$var=${!var}: expected $expected"
    done
}

zl_lock_run() {
    local run_dir=$1 lock="$1/${2:-.zero-lab.lock}" holder
    command -v flock >/dev/null 2>&1 || zl_die "flock not found on PATH: install util-linux (it locks the run folder)"
    mkdir -p "$run_dir"
    # a restart of this launch (zl_run_attempt) keeps the lock it already holds: the same open file
    if [[ -n "${zl_held_lock_fd:-}" && "$(readlink -f "/proc/$$/fd/$zl_held_lock_fd" 2>/dev/null)" == "$(realpath "$lock")" ]]
    then
        ZL_LOCK_FD=$zl_held_lock_fd
        flock -n "$ZL_LOCK_FD" || zl_die "run folder $run_dir: a restart lost its own lock $lock"
        return
    fi
    # <> opens without truncating: a refused launch must not erase who holds the lock
    exec {ZL_LOCK_FD}<>"$lock" || zl_die "cannot open the run lock $lock"
    if ! flock -n "$ZL_LOCK_FD"; then
        holder=$(head -n 1 "$lock" 2>/dev/null || true)
        zl_die "run folder $run_dir is in use by another launch (${holder:-holding $lock}): wait for it to end or" \
               "stop it; a second launch would mix its checkpoints and logs with the first's"
    fi
    printf 'pid %s on %s since %s\n' "$$" "$(hostname)" "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" > "$lock"
}

zl_resume_rule() {
    local flags=()
    [[ "${FRESH:-0}" == 1 ]] && flags+=(--fresh)
    [[ "${DRY_RUN:-0}" == 1 ]] && flags+=(--dry-run)
    RESUME_LOAD=$("$PYTHON" -m megatron.checkpointing.run_folder "$1" "${flags[@]}") || exit 1
}

zl_run_attempt() {
    local node=() restart=${zl_restart:-0} status=0 signalled=""
    if [[ "${5:-}" == --node ]]; then node=(--node "$6"); set -- "${@:1:4}" "${@:7}"; fi
    local note=$4; (( restart == 0 )) || note="restart $restart of $MAX_RESTARTS, $note"
    local attempt=("$PYTHON" -m megatron.launch.attempt --run-dir "$1" --log "$2" --launcher "$3" --note "$note"
                   "${node[@]}")
    (( restart < ${MAX_RESTARTS:-0} )) || exec "${attempt[@]}" -- "${@:5}"
    # restarts left: the attempt runs as a child, and one that failed of a fault worth restarting starts this
    # launch script again (the resume rule, the note), keeping the lock; a signal to the job ends it instead
    trap 'signalled=1' TERM INT HUP
    "${attempt[@]}" --restartable -- "${@:5}" || status=$?
    trap - TERM INT HUP
    if (( status == ZL_RESTART_STATUS )) && [[ -z "$signalled" ]]; then
        echo "[run] restarting the run from its newest intact checkpoint ($(( restart + 1 )) of $MAX_RESTARTS," \
             "MAX_RESTARTS)"
        zl_restart=$(( restart + 1 )) FRESH=0 zl_held_lock_fd=$ZL_LOCK_FD \
            exec bash "$ZL_LAUNCH_SCRIPT" "${ZL_LAUNCH_ARGS[@]}"
    fi
    if (( status == ZL_HOSTS_MISSING_STATUS )) && [[ -z "$signalled" ]]; then
        # a host gone for good: host 0 holds the run folder and the rendezvous, and goes on with its own ranks
        # (a ZeRO checkpoint of another data-parallel size loads only through the universal checkpoint; where
        # DeepSpeed cannot convert it, the ranks refuse in one line and the run ends there)
        if (( ${NNODES:-1} > 1 && ${NODE_RANK:-0} == 0 )); then
            echo "[run] the other hosts did not come back within HOST_WAIT_SECONDS=${HOST_WAIT_SECONDS:-600} s:" \
                 "going on with this host alone (NNODES=1, NGPUS=$NGPUS) from the newest intact checkpoint through" \
                 "--universal-checkpoint${GLOBAL_BATCH:+, the global batch kept at $GLOBAL_BATCH}" \
                 "($(( restart + 1 )) of $MAX_RESTARTS, MAX_RESTARTS)"
            zl_restart=$(( restart + 1 )) FRESH=0 zl_held_lock_fd=$ZL_LOCK_FD NNODES=1 GAS="" GLOBAL_BATCH=${GLOBAL_BATCH:-} \
                exec bash "$ZL_LAUNCH_SCRIPT" "${ZL_LAUNCH_ARGS[@]}" --universal-checkpoint
        fi
        echo "[run] host 0 did not come back: host $NODE_RANK cannot go on without it (it holds the run folder's" \
             "rendezvous); start the run again from host 0" >&2
    fi
    (( status != ZL_RESTART_STATUS && status != ZL_HOSTS_MISSING_STATUS )) || status=1  # a failure all the same
    exit "$status"
}
