#!/usr/bin/env bash
# Sourced by train-gpt3.sh: where the job runs (hosts, accelerators per host) and the
# environment every rank inherits. Sets alcf_hostfile_in (empty when the job has none),
# HOSTS, NHOSTS, NGPU_PER_HOST, NGPUS, ACCELERATOR (cuda|cpu), and PYTHON (scripts/launch_common.sh).

# PBS writes one line per MPI slot (repeated hosts); MPI hostfiles may add ":N" or " slots=N".
alcf_hosts_from_file() {
    [[ -f "$2" ]] || zl_die "$1=$2: hostfile does not exist"
    mapfile -t HOSTS < <(sed -e 's/#.*//' -e 's/[[:space:]].*//' -e 's/:.*//' "$2" | awk 'NF && !seen[$0]++')
    (( ${#HOSTS[@]} > 0 )) || zl_die "$1=$2: hostfile names no host"
    alcf_hostfile_in=$2
}

if [[ -n "${PBS_NODEFILE:-}" ]]; then
    alcf_hosts_from_file PBS_NODEFILE "$PBS_NODEFILE"
elif [[ -n "${HOSTFILE:-}" ]]; then
    alcf_hosts_from_file HOSTFILE "$HOSTFILE"
else
    alcf_hostfile_in=""
    HOSTS=("$(hostname)")
fi
NHOSTS=${#HOSTS[@]}

# CUDA_VISIBLE_DEVICES narrows what nvidia-smi lists, so it wins when set.
alcf_count_gpus() {
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        local -a ids
        IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
        echo "${#ids[@]}"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
    else
        echo 0
    fi
}
NGPU_DETECTED=$(alcf_count_gpus)
if (( NGPU_DETECTED > 0 )); then
    ACCELERATOR=cuda
    NGPU_PER_HOST=${NGPU_PER_HOST:-$NGPU_DETECTED}
else
    ACCELERATOR=cpu  # DeepSpeed's CPU accelerator, NGPU_PER_HOST CPU ranks per host
    NGPU_PER_HOST=${NGPU_PER_HOST:-2}
fi
[[ "$NGPU_PER_HOST" =~ ^[1-9][0-9]*$ ]] || zl_die "NGPU_PER_HOST=$NGPU_PER_HOST: expected a positive integer"
if [[ "$ACCELERATOR" == cpu ]]; then
    export DS_ACCELERATOR=cpu
    # Ranks on one host share its cores; without this each one starts a thread per core.
    ALCF_THREADS=$(( $(nproc) / NGPU_PER_HOST ))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ALCF_THREADS > 0 ? ALCF_THREADS : 1 ))}
fi
NGPUS=$(( NHOSTS * NGPU_PER_HOST ))

if [[ -n "${VENV_DIR:-}" ]]; then
    [[ -f "$VENV_DIR/bin/activate" ]] || zl_die "VENV_DIR=$VENV_DIR: no bin/activate there (not a virtual environment)"
    # shellcheck disable=SC1091
    source "$VENV_DIR/bin/activate"
    PYTHON=${PYTHON:-$VENV_DIR/bin/python}
fi
zl_find_python "$REPO_ROOT"  # PYTHON, else the repository's .venv, else python3 on PATH; it must import torch

export CUDA_DEVICE_MAX_CONNECTIONS=1  # one hardware queue keeps kernels in issue order (Megatron TP/SP overlap needs it)
export IBV_FORK_SAFE=1                # data loader workers fork after InfiniBand is initialised
echo "[setup] hosts: ${HOSTS[*]} | NHOSTS=$NHOSTS NGPU_PER_HOST=$NGPU_PER_HOST NGPUS=$NGPUS accelerator=$ACCELERATOR"
