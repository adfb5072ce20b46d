# Shared by the examples_zero/gpt_deepspeed_*.sh drivers (sourced, never run alone).
# The driver sets zl_driver_stage (its ZeRO stage), EXPERIMENT (DP|Z1|Z2|Z3|Z3_OL|Z3_NVMe) and zl_driver_offload=1
# for CPU offload or zl_driver_offload=nvme for NVMe offload (files under NVME_PATH, default <run folder>/nvme);
# everything else is an environment default here, identical for all the drivers so runs compare
# (docs/environment.md lists every variable). Extra arguments to the driver are passed to pretrain_gpt.py
# last, so they override.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO/scripts/launch_common.sh"  # finding Python, the resume rule, one attempt of a run
zl_find_python "$REPO"
# This Python's tools first: torch builds DeepSpeed's C++ ops with the first `ninja` on PATH, and two
# different ninjas (a venv's and the system's) invalidate each other's builds on every start.
export PATH=$(dirname "$PYTHON"):$PATH

# INIT_HF=<Hugging Face GPT-2 folder>: fine-tune its weights instead of starting from random ones.
# Its shape picks MODEL_SIZE (gpt2 = 125M, gpt2-medium = 355M, gpt2-large = 774M, gpt2-xl = 1.5B).
if [[ -n "${INIT_HF:-}" ]]; then
    [[ -f "$INIT_HF/config.json" ]] || zl_die "INIT_HF=$INIT_HF: not a Hugging Face model folder (no config.json)"
    read -r hf_size hf_positions < <("$PYTHON" -c 'import json, sys
from megatron.model import MODEL_PRESETS
c = json.load(open(sys.argv[1]))
shape = dict(num_layers=c.get("n_layer"), hidden_size=c.get("n_embd"), num_attention_heads=c.get("n_head"))
print(next((name for name, preset in MODEL_PRESETS.items() if preset == shape), "none"), c.get("n_positions"))' \
        "$INIT_HF/config.json") || zl_die "INIT_HF=$INIT_HF: cannot read $INIT_HF/config.json"
    [[ "$hf_size" != none ]] || zl_die "INIT_HF=$INIT_HF: its n_layer/n_embd/n_head match no MODEL_SIZE preset"
    [[ "${MODEL_SIZE:-$hf_size}" == "$hf_size" ]] || zl_die "INIT_HF=$INIT_HF is a $hf_size model but MODEL_SIZE=$MODEL_SIZE"
    MODEL_SIZE=$hf_size
fi

# With a GPU: GPT-2 125M, seq 1024, bf16 on every visible GPU via the deepspeed launcher.
# Without: the tiny preset on 2 CPU ranks via torchrun, fp32, a few minutes per driver (scripts/defaults.sh).
# LAUNCHER=srun (inside a Slurm allocation): one rank per task of the allocation, on all its nodes.
zl_check "torchrun|deepspeed|mpiexec|srun" LAUNCHER
zl_check int NGPUS NNODES HOST_WAIT_SECONDS
zl_check count NODE_RANK
# Each driver is one experiment at one ZeRO stage (ALCF/ takes ZERO_STAGE): another ZERO_STAGE is refused
[[ -z "${ZERO_STAGE:-}" || "$ZERO_STAGE" == "$zl_driver_stage" ]] || zl_die "ZERO_STAGE=$ZERO_STAGE:" \
    "gpt_deepspeed_$EXPERIMENT.sh runs ZeRO stage $zl_driver_stage (each driver is one experiment:" \
    "gpt_deepspeed_DP.sh, _Z1, _Z2 and _Z3 run stages 0 to 3): run that stage's driver, or leave ZERO_STAGE unset"
ZERO_STAGE=$zl_driver_stage
# ... and at one offload: OFFLOAD other than the driver's own (0: none) is refused, as ZERO_STAGE is
zl_driver_offload=${zl_driver_offload:-0}
[[ -z "${OFFLOAD:-}" || "$OFFLOAD" == "$zl_driver_offload" ]] || zl_die "OFFLOAD=$OFFLOAD:" \
    "gpt_deepspeed_$EXPERIMENT.sh runs with OFFLOAD=$zl_driver_offload (each driver is one experiment:" \
    "gpt_deepspeed_Z3_OL.sh offloads to CPU memory, OFFLOAD=1; gpt_deepspeed_Z3_NVMe.sh to NVMe, OFFLOAD=nvme; the" \
    "others offload nothing): run that driver, or leave OFFLOAD unset"
OFFLOAD=$zl_driver_offload
[[ "${LAUNCHER:-}" == srun && -z "${NGPUS:-}" ]] && NGPUS=${SLURM_NTASKS:-}
if (( ZL_CUDA_GPUS > 0 )); then
    ZL_ACCELERATOR=cuda; MODEL_SIZE=${MODEL_SIZE:-125M}; NGPUS=${NGPUS:-$ZL_CUDA_GPUS}; LAUNCHER=${LAUNCHER:-deepspeed}
else
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    ZL_ACCELERATOR=cpu; MODEL_SIZE=${MODEL_SIZE:-tiny}; NGPUS=${NGPUS:-2}; LAUNCHER=${LAUNCHER:-torchrun}
fi
[[ "$LAUNCHER" != srun || -n "${SLURM_JOB_ID:-}" ]] \
    || zl_die "LAUNCHER=srun: not inside a Slurm allocation (no SLURM_JOB_ID): use sbatch or salloc"
# CUDA_VISIBLE_DEVICES=4,5 under the deepspeed launcher: its --num_gpus would re-export 0..N-1 (GPUs 0 and 1);
# --include names the GPUs themselves, the first NGPUS of those visible
ds_include=""
if [[ "$LAUNCHER" == deepspeed && -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    [[ "$CUDA_VISIBLE_DEVICES" =~ ^[0-9]+(,[0-9]+)*$ ]] || zl_die "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: the" \
        "deepspeed launcher takes GPU indices (e.g. 4,5); use LAUNCHER=torchrun, which keeps it as it is"
    IFS=, read -r -a visible_gpus <<< "$CUDA_VISIBLE_DEVICES"
    (( NGPUS <= ${#visible_gpus[@]} )) || zl_die "NGPUS=$NGPUS: more than the ${#visible_gpus[@]} GPUs" \
        "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES makes visible"
    ds_include=localhost:$(IFS=,; echo "${visible_gpus[*]:0:NGPUS}")
fi

# torchrun across hosts: the same driver on each host with NNODES, NODE_RANK (0 on the first) and MASTER_ADDR
# (the first host), ranks meeting through torchrun's c10d rendezvous; NGPUS ranks on each host. Host 0 owns
# the run folder (the resume rule, train.log, command.txt); host k writes train.nodek.log beside them.
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}
(( NODE_RANK < NNODES )) || zl_die "NODE_RANK=$NODE_RANK: expected 0 to NNODES-1 ($((NNODES - 1)))"
if (( NNODES > 1 )); then
    [[ "$LAUNCHER" == torchrun ]] || zl_die "NNODES=$NNODES: several hosts by NNODES take LAUNCHER=torchrun; srun and" \
                                             "mpiexec (ALCF/) start the ranks of every host themselves"
    [[ -n "${MASTER_ADDR:-}" ]] || zl_die "NNODES=$NNODES: set MASTER_ADDR to the first host (NODE_RANK 0), the same on every host"
fi
ZL_WORLD=$(( NGPUS * NNODES ))  # every rank of the job (srun's and mpiexec's NGPUS count them all; NNODES is 1 there)
ZL_MODEL_VARIABLE=MODEL_SIZE
"$PYTHON" "$REPO/megatron/model/presets.py" "$MODEL_SIZE" >/dev/null 2>&1 \
    || zl_die "MODEL_SIZE=$MODEL_SIZE: expected a preset ($("$PYTHON" -c 'import megatron.model.presets as p
print(", ".join(p.MODEL_PRESETS))'))"
# What both launch paths share: sequence, batch (global = MICRO_BATCH x GAS x data-parallel size), length,
# precision, TP/PP/SP, activation checkpointing, data, optimizer, intervals: TRAINING_DEFAULT_FLAGS. Without
# gradient accumulation the stages send the ZeRO paper's volumes per step (stages 0-2: 2x the parameters,
# stage 3: 3x); with it (GAS > 1), stages 2 and 3 communicate at every micro-batch (docs/zero-tradeoff.md).
source "$REPO/scripts/defaults.sh"
MASTER_PORT=${MASTER_PORT:-29500}

# The default dataset is made on first use; any other DATA_PATH is checked by pretrain_gpt.py.
if [[ "${DRY_RUN:-0}" != 1 && "$DATA_PATH" == "$DATA_DIR/dolly_text_document" && ! ( -f "$DATA_PATH.bin" && -f "$DATA_PATH.idx" ) ]]; then
    echo "[examples_zero] $DATA_PATH.bin missing: running tools/process_databricks_gpt2.sh"
    DATA_DIR=$DATA_DIR PYTHON=$PYTHON bash "$REPO/tools/process_databricks_gpt2.sh"
fi

RUNS_DIR=${RUNS_DIR:-$REPO/runs}
parallel_tag=""; (( TP > 1 )) && parallel_tag+="_tp$TP"; (( PP > 1 )) && parallel_tag+="_pp$PP"
[[ "$SP" == 1 ]] && parallel_tag+="_sp"
RUN_NAME=${RUN_NAME:-gpt_${MODEL_SIZE}_${EXPERIMENT}${parallel_tag}}
RUN_DIR=$(realpath -m "$RUNS_DIR/$RUN_NAME")
echo "[examples_zero] $RUN_NAME -> $RUN_DIR"
# A run folder holding an intact checkpoint resumes from it; FRESH=1 moves its old files aside and starts
# afresh (scripts/launch_common.sh; on host 0 only). DRY_RUN=1: say what would happen, write and start nothing.
RESUME_LOAD=""
if [[ "${DRY_RUN:-0}" != 1 ]]; then  # one launch per run folder (host k of a torchrun run: one per host)
    if (( NODE_RANK > 0 )); then zl_lock_run "$RUN_DIR" ".zero-lab.node$NODE_RANK.lock"; else zl_lock_run "$RUN_DIR"; fi
fi
# Host k asks the same rule without acting on it (host 0 moves and converts; the folder is shared): both
# hosts then pass the same --load, and only host 0 converts INIT_HF.
if (( NODE_RANK > 0 )); then DRY_RUN=1 zl_resume_rule "$RUN_DIR"; else zl_resume_rule "$RUN_DIR"; fi
# --load always, as Megatron's scripts pass it: pretrain_gpt.py resumes what <run>/checkpoints holds then
# (rank 0 reads it for every rank), and starts afresh when it holds nothing
resume_flags=(--load "$RUN_DIR/checkpoints")

# INIT_HF is converted once into the run folder, then loaded with --finetune (iteration and optimizer
# start afresh; any ZeRO stage); GPT-2's position table (1024) replaces --max-position-embeddings SEQ_LEN.
# A resumed run continues from its own checkpoint instead.
init_flags=()
if [[ -n "${INIT_HF:-}" && -z "$RESUME_LOAD" ]]; then
    resume_flags=()
    init_dir=$RUN_DIR/hf_init_$(basename "$INIT_HF")
    [[ -f "$init_dir/latest" || "${DRY_RUN:-0}" == 1 ]] || (( NODE_RANK > 0 )) \
        || "$PYTHON" "$REPO/tools/hf_to_checkpoint.py" --hf "$INIT_HF" --save "$init_dir" || exit 1
    init_flags=(--max-position-embeddings "$hf_positions" --load "$init_dir" --finetune)
fi
[[ -n "${INIT_HF:-}" && -n "$RESUME_LOAD" ]] && init_flags=(--max-position-embeddings "$hf_positions")

offload_flags=(); [[ "$OFFLOAD" == 1 ]] && offload_flags=(--zero-offload-optimizer --zero-offload-params)
# OFFLOAD=nvme: ZeRO-Infinity, optimizer states and parameters in files under NVME_PATH (an NVMe drive's folder)
[[ "$OFFLOAD" == nvme ]] && offload_flags=(--zero-nvme-path "${NVME_PATH:-$RUN_DIR/nvme}")
case "$LAUNCHER" in
    torchrun)  launch=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPUS" --master_port "$MASTER_PORT")
               # several hosts: c10d rendezvous at MASTER_ADDR; host 0 holds the store (is_host: a host
               # whose own name resolves to 127.0.1.1 would not know MASTER_ADDR as its own); the hosts wait
               # HOST_WAIT_SECONDS for each other there (torchrun's join_timeout), then give up
               (( NNODES == 1 )) || launch=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPUS"
                   --nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_backend c10d --rdzv_id "$RUN_NAME"
                   --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
                   --rdzv_conf "is_host=$(( NODE_RANK == 0 )),join_timeout=${HOST_WAIT_SECONDS:-600}") ;;
    deepspeed) launch=("$PYTHON" -m deepspeed.launcher.runner --num_gpus "$NGPUS" --master_port "$MASTER_PORT")
               [[ -z "$ds_include" ]] \
                   || launch=("$PYTHON" -m deepspeed.launcher.runner --include "$ds_include" --master_port "$MASTER_PORT") ;;
    # Each task finds its rank and the rendezvous in SLURM_* (megatron/launch/dist_env.py); one OpenMP
    # thread per CPU of the task, as torchrun's one per rank when tasks get no --cpus-per-task. srun is given
    # the job's --cpus-per-task itself: since Slurm 22.05 it no longer takes it from the job (only from
    # SRUN_CPUS_PER_TASK), and would bind each task to one CPU.
    srun)      export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
               launch=(srun --ntasks "$NGPUS" ${SLURM_CPUS_PER_TASK:+--cpus-per-task "$SLURM_CPUS_PER_TASK"}
                       --kill-on-bad-exit=1 "$PYTHON") ;;
    # MPICH (Hydra), PALS or Open MPI on this host: each rank finds its rank in the MPI variables
    # (megatron/launch/dist_env.py) and MASTER_PORT in the environment mpiexec passes on; one OpenMP thread
    # per rank, as torchrun sets.
    mpiexec)   export MASTER_PORT OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
               launch=(mpiexec -n "$NGPUS" "$PYTHON") ;;
esac

cmd=("${launch[@]}" "$REPO/pretrain_gpt.py" "${TRAINING_DEFAULT_FLAGS[@]}"
     --zero-stage "$ZERO_STAGE" "${offload_flags[@]}" --save "$RUN_DIR/checkpoints"
     "${init_flags[@]}" "${resume_flags[@]}" --tensorboard-dir "$RUN_DIR/tensorboard" --run-dir "$RUN_DIR"
     --exit-signal-handler "$@")  # SIGTERM (preemption): save this iteration, exit 0 (docs/checkpoints.md)
# an error about one of these flags names the variable it came from (megatron/launch/flag_sources.py)
export ZERO_LAB_FLAG_SOURCES="--zero-nvme-path=NVME_PATH $TRAINING_DEFAULT_SOURCES"

if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "[examples_zero] DRY_RUN=1, not starting: $(printf '%q ' "${cmd[@]}")"; exit 0; fi
note="fresh start"; [[ -n "$RESUME_LOAD" ]] && note="resuming from $RESUME_LOAD"
if (( NODE_RANK > 0 )); then  # host k's ranks: their output beside host 0's (which holds the run's log)
    note="host $NODE_RANK of $NNODES"
    zl_run_attempt "$RUN_DIR" "$RUN_DIR/train.node$NODE_RANK.log" "$LAUNCHER" "$note" --node "node$NODE_RANK" "${cmd[@]}"
fi
zl_run_attempt "$RUN_DIR" "$RUN_DIR/train.log" "$LAUNCHER" "$note" "${cmd[@]}"
