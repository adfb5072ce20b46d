#!/usr/bin/env bash
# The GPU acceptance run (docs/gpu.md): on every visible GPU, GPT-2 125M and 355M at seq 1024 in
# bf16, the five ZeRO drivers (DP, Z1, Z2, Z3, Z3_OL) for SUITE_ITERS iterations each, then
# analysis/summarize.py over those runs (MFU from the GPU's peak), then bench/bench_gpt_vs_hf.py
# on CUDA in bf16 without and with --compile. About 15 minutes on one H100.
#
# Usage: bash bench/gpu_suite.sh [--dry-run] [--only PARTS | --quick | --perf]
#   --dry-run     print every command, run none (works without a GPU)
#   --quick       the quick profile, for a GPU machine without network that gives one command a few minutes:
#                 installs zero-lab from GPU_CARRY (gpu_carry/, made by scripts/gpu_carry.sh) where PYTHON
#                 lacks it, builds DeepSpeed's CPU Adam in the background while DP to Z3 train, then GPT-2
#                 125M only, SUITE_ITERS (25) iterations per driver logged every 5, the bench once without
#                 --compile, and the report. It prints its plan first: each step's expected minutes (written
#                 down from what the step does, not timed here) and their sum; the report adds what each took.
#   --perf        issue 55's performance profile, for the same kind of machine: installs as --quick does, then
#                 GPT-2 125M DP, Z1, Z2, Z3 (SUITE_ITERS (20) iterations logged every 5, micro-batch 8),
#                 bench/bench_syncs.py (125M at stages 0-3 before and after: tokens/s and synchronizations
#                 per step), bench_gpt_vs_hf.py once, GPT-2 355M Z1 with MICRO_BATCH unset (the drivers' choice)
#                 without and with --compile, and bench/gpu_perf_report.py's page (each figure beside its
#                 target). Its plan sums under 9 minutes; each step gets what is left of PERF_BUDGET (510 s)
#                 and the report runs whatever happened, so the command ends in about 9 minutes at most.
#   --only PARTS  comma-separated parts of the suite: a model (125M, 355M: its five drivers), bench,
#                 report (the summary and the results page); for machines that run one command for
#                 at most a few minutes. Without it all parts run, after emptying SUITE_RUNS.
# Writes bench/results/<gpu-name>.md (machine, versions, settings, the tables; "<count>x-" before
# the name with several GPUs) and <gpu-name>-summary.{csv,json} beside it; the runs, the full
# summary and its plots stay in SUITE_RUNS (runs/gpu_suite, emptied first). Settings: SUITE_MODELS ("125M 355M"),
# SUITE_ITERS (60), SUITE_RUNS, MICRO_BATCH (8; the drivers' GPU default), PYTHON (default the repo's .venv,
# else python3 on PATH: scripts/find_python.sh); DATA_DIR, DATA_PATH, VOCAB_FILE, MERGE_FILE as the drivers
# read them, WHEELHOUSE (wheelhouse/) where there is no network.
# Before the first run it checks that the GPU, zero-lab's packages and the data are there and stops in one
# line naming what is missing (the dry run prints that line as a note); missing default data is made once
# first where the hub answers.
# Exit status: 0 when every step passed, 1 when one failed (the others still run; the results
# file names the failed steps).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
source scripts/find_python.sh

usage="usage: bench/gpu_suite.sh [--dry-run] [--only PARTS | --quick | --perf]"
dry_run=0 only="" quick=0 perf=0
while (( $# )); do
    case "$1" in
        --dry-run) dry_run=1; shift ;;
        --only) [[ $# -ge 2 ]] || zl_die "--only needs a list such as 125M,bench ($usage)"
                only=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        --perf) perf=1; shift ;;
        *) zl_die "unknown argument $1 ($usage)" ;;
    esac
done
[[ -z "$only" ]] || (( ! quick && ! perf )) || zl_die "--quick and --perf run their own parts: leave out --only ($usage)"
(( ! quick || ! perf )) || zl_die "--quick and --perf are two profiles: choose one ($usage)"
RUNS=${SUITE_RUNS:-$REPO/runs/gpu_suite}
MICRO_BATCH=${MICRO_BATCH:-8}
if (( quick || perf )); then
    MODELS=125M ITERS=${SUITE_ITERS:-25} LOG_EVERY=5
    (( ! perf )) || ITERS=${SUITE_ITERS:-20}
    CARRY=$(realpath -m "${GPU_CARRY:-$REPO/gpu_carry}")
    DATA_DIR=${DATA_DIR:-$CARRY/data} WHEELHOUSE=${WHEELHOUSE:-$CARRY/wheelhouse}
else
    MODELS=${SUITE_MODELS:-125M 355M} ITERS=${SUITE_ITERS:-60} LOG_EVERY=10
fi
for part in ${only//,/ }; do
    [[ " $MODELS bench report " == *" $part "* ]] \
        || zl_die "--only $only: unknown part $part (expected: ${MODELS// /, }, bench, report)"
done
wanted() { [[ -z "$only" || ",$only," == *",$1,"* ]]; }
drivers_wanted() { local model; for model in $MODELS; do wanted "$model" && return 0; done; return 1; }

zl_find_python "$REPO"  # the one way every script finds Python
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) \
    || zl_die "PYTHON=$PYTHON cannot import torch: run 'bash scripts/setup.sh' (it makes $REPO/.venv), or set PYTHON" \
              "to a Python that has torch"

# What the runs need, checked once before the first, so that a missing piece is one line here rather than
# ten drivers each retrying the hub and failing: the GPU, zero-lab's packages (installed from a wheelhouse
# where there is no network) and the data the drivers read (named as the launch planner's settings name it).
DATA_DIR=${DATA_DIR:-$REPO/data}
DATA_PATH=${DATA_PATH:-$DATA_DIR/dolly_text_document}
VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$DATA_DIR/gpt2-merges.txt}
online() {  # $1 answers within 10 s (HF_HUB_OFFLINE=1 and PIP_NO_INDEX=1 say there is no network, as they do to hub and pip)
    [[ "${HF_HUB_OFFLINE:-0}" != 1 && "${PIP_NO_INDEX:-}" != 1 ]] \
        && curl --silent --head --max-time 10 --output /dev/null "$1" 2>/dev/null
}
missing=()
(( gpus > 0 )) || missing+=("a CUDA GPU (torch.cuda.device_count() is 0 for PYTHON=$PYTHON)")
install=0
if "$PYTHON" -c 'import deepspeed, megatron.data.helpers' >/dev/null 2>&1; then
    :
elif (( quick || perf )); then  # installed below, from the carry folder
    install=1
    [[ -d "$WHEELHOUSE" ]] || missing+=("the wheelhouse $WHEELHOUSE to install zero-lab's packages from (build \
the carry folder with bash scripts/gpu_carry.sh where there is network and bring $CARRY here, docs/gpu.md)")
else
    wheelhouse=${WHEELHOUSE:-$REPO/wheelhouse}
    if online https://pypi.org/simple/; then
        missing+=("zero-lab's packages for PYTHON=$PYTHON (run bash scripts/setup.sh)")
    elif [[ -d "$wheelhouse" ]]; then
        missing+=("zero-lab's packages for PYTHON=$PYTHON (no network: run WHEELHOUSE=$wheelhouse bash scripts/setup.sh)")
    else
        missing+=("zero-lab's packages for PYTHON=$PYTHON, and with no network a wheelhouse to install them from \
($wheelhouse: build it with scripts/wheelhouse.sh where there is network, docs/gpu.md)")
    fi
fi
make_data=0 skip_drivers=0
if drivers_wanted; then
    absent=()
    for word in $DATA_PATH; do  # one prefix, or "weight prefix weight prefix ..."
        [[ "$word" =~ ^[0-9.eE+-]+$ ]] && continue
        for file in "$word.bin" "$word.idx"; do [[ -f "$file" ]] || absent+=("$file"); done
    done
    for file in "$VOCAB_FILE" "$MERGE_FILE"; do [[ -f "$file" ]] || absent+=("$file"); done
    if (( ${#absent[@]} )); then
        if [[ "$DATA_PATH" != "$DATA_DIR/dolly_text_document" ]]; then
            missing+=("the data ${absent[*]} (DATA_PATH=$DATA_PATH)")
        elif (( quick || perf )); then
            missing+=("the data ${absent[*]} (build the carry folder with bash scripts/gpu_carry.sh where there \
is network and bring $CARRY here)")
        elif online https://huggingface.co; then
            make_data=1  # made once below, before the first driver
        else
            missing+=("the data ${absent[*]} (no network to make it: run bash tools/process_databricks_gpt2.sh \
where there is network and copy $DATA_DIR here)")
        fi
    fi
fi
if (( ${#missing[@]} )); then
    what=$(printf '%s; ' "${missing[@]}")
    (( dry_run )) || zl_die "the GPU suite cannot start: missing ${what%; }"
    echo "[gpu_suite] dry run: a real run would stop here, missing ${what%; }"
fi
if (( gpus > 0 )); then
    gpu_name=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")
else
    gpus=1 gpu_name="no GPU (dry run)"
fi
slug=$(tr '[:upper:]' '[:lower:]' <<< "$gpu_name" | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')
(( gpus == 1 )) || slug="${gpus}x-$slug"
RESULTS=$REPO/bench/results/$slug.md

failed=()
# Every command goes through `step`: printed, then run unless --dry-run; a failure is recorded. The quick
# profile also records how long each took (STEP_NAME names it) beside the plan's minutes, for the report.
# Under --perf a step gets what is left of PERF_BUDGET seconds since the start (timeout, which stops the step's
# process group) and is skipped with under 20 left; the report's steps (UNBOUNDED=1) run whatever is left.
STEP_NAME="" UNBOUNDED=0 BUDGET=${PERF_BUDGET:-510}
step() {
    printf '+'; printf ' %q' "$@"; echo
    (( dry_run )) && return
    local started=$SECONDS limit=()
    if (( perf && ! UNBOUNDED )); then
        local left=$((BUDGET - SECONDS))
        (( left >= 20 )) || { echo "[gpu_suite] SKIPPED (PERF_BUDGET=$BUDGET s spent): $*" >&2
                              failed+=("skipped, PERF_BUDGET spent: $*"); return; }
        limit=(timeout --kill-after=15 "$left")
    fi
    local rc=0
    "${limit[@]}" "$@" || rc=$?
    if (( rc )); then
        local what="$*"
        (( ! ${#limit[@]} || (rc != 124 && rc != 137) )) || what="$* (stopped: PERF_BUDGET spent)"
        echo "[gpu_suite] FAILED: $what" >&2; failed+=("$what")
    fi
    [[ -z "$STEP_NAME" ]] || printf '%s\t%s\n' "$STEP_NAME" "$((SECONDS - started))" >> "$RUNS/steps.tsv"
}

# The quick profile's plan: minutes each step is expected to take on one GPU of a 16-core machine, written
# down from what the step does and set against the first quick run, on one H100
# (bench/results/nvidia-h100-80gb-hbm3.md, which lists each step's minutes): a driver's start-up is the
# driver's shell (about 7 s: Python started for the checks and the resume rule), the deepspeed launcher and
# the rank each importing torch and DeepSpeed (about 10 s), the start-up probes and the engine with its data
# index (about 20 s); 25 iterations of 125M at micro-batch 8 x 1024 tokens in bf16 take 1 to 7 s, Z3_OL's
# about 8 s (CPU Adam over 125M parameters on the host). The CPU Adam build is one compile of about 3 min.
plan=()
planned() { plan+=("$1"$'\t'"$2"$'\t'"$3"); }  # NAME MINUTES WHAT (MINUTES "-" for a background step)
if (( quick )); then
    (( install )) && planned install 0.6 "install zero-lab from $WHEELHOUSE (a venv beside PYTHON's torch, about 15 wheels, the C++ helper compiled)"
    planned op_build - "build DeepSpeed's CPU Adam for Z3_OL (about 3 min, in the background while DP to Z3 train)"
    for experiment in DP Z1 Z2 Z3; do planned "$experiment" 0.8 "$experiment driver: start-up 0.7 + $ITERS iterations 0.1"; done
    planned Z3_OL 1.0 "Z3_OL driver: start-up 0.8 (pinned host buffers) + $ITERS iterations 0.2"
    planned bench 1.7 "bench_gpt_vs_hf.py, stages 0-3: 8 engines (ours and HF) of 10 steps, about 12 s each, and start-up"
    planned report 0.2 "summarize.py (tables and plots) and the results page"
fi
# The performance profile's plan, from the same first run: a 125M driver's start-up 0.6 min and 20 iterations of
# under 0.1 now that Z2 and Z3 step near Z1's 42 ms; an engine of the in-process benches about 8 s with its steps.
# 355M: an engine of 3x the parameters (about 10 s more), its iterations about 3x 125M's FLOPs at the planned
# micro-batch; torch.compile of the model about 0.8 min (an estimate: no compile has been timed on a GPU here).
if (( perf )); then
    (( install )) && planned install 0.6 "install zero-lab from $WHEELHOUSE (a venv beside PYTHON's torch, about 15 wheels, the C++ helper compiled)"
    for experiment in DP Z1 Z2 Z3; do planned "$experiment" 0.7 "$experiment driver, 125M: start-up 0.6 + $ITERS iterations 0.1"; done
    planned syncs 1.2 "bench_syncs.py, 125M at stages 0-3 before and after: 8 engines of 15 steps (3 profiled), about 8 s each, and start-up 0.2"
    planned bench 1.5 "bench_gpt_vs_hf.py, stages 0-3: 8 engines (ours and HF) of 10 steps, about 10 s each, and start-up"
    planned 355M 0.9 "Z1 driver, 355M, MICRO_BATCH unset (the drivers' choice): start-up 0.7 + $ITERS iterations 0.2"
    planned 355M_compile 1.7 "the same with --compile: start-up 0.7 + torch.compile about 0.8 + $ITERS iterations 0.2"
    planned report 0.1 "summarize.py and the results page (bench/gpu_perf_report.py)"
fi
if (( quick || perf )); then
    total=0 profile=quick most=7
    (( ! perf )) || profile=performance most=9
    echo "[gpu_suite] $profile profile plan, expected minutes on one GPU (estimates from what each step does):"
    for row in "${plan[@]}"; do
        IFS=$'\t' read -r name minutes what <<< "$row"
        printf '[gpu_suite]   %-6s %-8s %s\n' "$minutes" "$name" "$what"
        [[ "$minutes" == - ]] || total=$(awk -v a="$total" -v b="$minutes" 'BEGIN { print a + b }')
    done
    printf '[gpu_suite]   %-6s %s\n' "$total" "in all (at most $most)"
fi

echo "[gpu_suite] $gpus x $gpu_name: models $MODELS, $ITERS iterations per driver, runs in $RUNS"
# The summary reads every run below SUITE_RUNS: none may be left from an earlier suite.
[[ -n "$only" ]] || step rm -rf "$RUNS"
(( dry_run )) || mkdir -p "$RUNS"
if (( install )); then
    # setup.sh keeps PYTHON's torch (the venv sees its packages) and what it has within setup.py's ranges;
    # without the [test] extra, which the carried wheelhouse leaves out. Nothing runs without it.
    STEP_NAME=install step env WHEELHOUSE="$WHEELHOUSE" SETUP_EXTRAS= PYTHON="$PYTHON" bash scripts/setup.sh
    (( ${#failed[@]} == 0 )) || zl_die "the GPU suite cannot start: installing from $WHEELHOUSE failed" \
                                       "(scripts/setup.sh's last line above; its log: build/setup.log)"
    PYTHON=$REPO/.venv/bin/python
fi
op_build_pid=""
if (( quick )); then
    # DeepSpeed compiles its CPU Adam at the first offloading run; built here beside DP to Z3, Z3_OL finds it
    # cached (TORCH_EXTENSIONS_DIR). The venv's and PYTHON's tools first: torch builds with the first ninja.
    build_op=(env PATH="$(dirname "$PYTHON"):$PATH" "$PYTHON" -c
              'from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)')
    printf '+'; printf ' %q' "${build_op[@]}"; echo ' &'
    if (( ! dry_run )); then
        started_op=$SECONDS
        "${build_op[@]}" > "$RUNS/op_build.out" 2>&1 & op_build_pid=$!
    fi
fi
if (( make_data )); then  # the drivers would make it too, but one at a time and each retrying on failure
    step env DATA_DIR="$DATA_DIR" PYTHON="$PYTHON" bash tools/process_databricks_gpt2.sh
    (( dry_run )) || [[ -f "$DATA_PATH.bin" && -f "$DATA_PATH.idx" ]] \
        || { echo "[gpu_suite] no data in $DATA_DIR: the drivers are skipped" >&2; skip_drivers=1; }
fi
# Checkpoints are not part of the measurement and a 355M one is GBs: --save '' writes none (pretrain_gpt.py
# reads an empty --save as no --save; it comes after the driver's own --save RUN/checkpoints, so it wins).
for model in $MODELS; do
    wanted "$model" && (( ! skip_drivers )) || continue
    experiments="DP Z1 Z2 Z3 Z3_OL"
    (( ! perf )) || experiments="DP Z1 Z2 Z3"  # no offload: its targets are at stages 0-3
    for experiment in $experiments; do
        if [[ "$experiment" == Z3_OL && -n "$op_build_pid" ]]; then
            echo "[gpu_suite] waiting for the CPU Adam build (log: $RUNS/op_build.out)"
            if wait "$op_build_pid"; then
                printf 'op_build\t%s\n' "$((SECONDS - started_op))" >> "$RUNS/steps.tsv"
            else
                echo "[gpu_suite] FAILED: building DeepSpeed's CPU Adam; its log's end:" >&2
                tail -n 5 "$RUNS/op_build.out" >&2
                failed+=("building DeepSpeed's CPU Adam (log: $RUNS/op_build.out)")
            fi
        fi
        STEP_NAME=$experiment step env RUNS_DIR="$RUNS" MODEL_SIZE="$model" SEQ_LEN=1024 PRECISION=bf16 \
            MICRO_BATCH="$MICRO_BATCH" NGPUS="$gpus" TRAIN_ITERS="$ITERS" LOG_INTERVAL="$LOG_EVERY" \
            EVAL_INTERVAL="$ITERS" EVAL_ITERS=2 DATA_DIR="$DATA_DIR" PYTHON="$PYTHON" \
            bash examples_zero/gpt_deepspeed_$experiment.sh --save ''
    done
done

# GPT-2 125M's shape; one stage with --compile (each engine compiles anew, which takes minutes).
bench_shape=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
             --micro-batch-size "$MICRO_BATCH" --gradient-accumulation 1 --bf16)
launch=("$PYTHON" -m torch.distributed.run --nproc_per_node "$gpus" --master_port 29510)
(( ! perf )) || STEP_NAME=syncs step "${launch[@]}" bench/bench_syncs.py "${bench_shape[@]}" --json "$RUNS/bench_syncs.json"
if wanted bench; then
    STEP_NAME=bench step "${launch[@]}" bench/bench_gpt_vs_hf.py "${bench_shape[@]}" --json "$RUNS/bench_gpt_vs_hf.json"
    (( quick || perf )) || step "${launch[@]}" bench/bench_gpt_vs_hf.py "${bench_shape[@]}" --stages 1 --compile \
        --json "$RUNS/bench_gpt_vs_hf_compile.json"
fi
if (( perf )) && (( ! skip_drivers )); then
    # GPT-2 355M at ZeRO-1 with the micro-batch the drivers choose (MICRO_BATCH unset), without and with --compile
    z1_355m=(env -u MICRO_BATCH RUNS_DIR="$RUNS" MODEL_SIZE=355M SEQ_LEN=1024 PRECISION=bf16 NGPUS="$gpus"
             TRAIN_ITERS="$ITERS" LOG_INTERVAL="$LOG_EVERY" EVAL_INTERVAL="$ITERS" EVAL_ITERS=2 DATA_DIR="$DATA_DIR"
             PYTHON="$PYTHON")
    STEP_NAME=355M step "${z1_355m[@]}" bash examples_zero/gpt_deepspeed_Z1.sh --save ''
    STEP_NAME=355M_compile step "${z1_355m[@]}" RUN_NAME=gpt_355M_Z1_compile \
        bash examples_zero/gpt_deepspeed_Z1.sh --save '' --compile
fi
if (( perf )); then
    UNBOUNDED=1 STEP_NAME=report step "$PYTHON" analysis/summarize.py "$RUNS"
    UNBOUNDED=1 step "$PYTHON" bench/gpu_perf_report.py --runs "$RUNS" --out "$RESULTS" --iters "$ITERS" \
        --log-interval "$LOG_EVERY" --micro-batch "$MICRO_BATCH" --baseline "$REPO/bench/results/nvidia-h100-80gb-hbm3-summary.json" \
        --plan "${plan[@]}" --failed "${failed[@]}"
elif wanted report; then
    profile=(); (( quick )) && profile=(--quick --plan "${plan[@]}")
    STEP_NAME=report step "$PYTHON" analysis/summarize.py "$RUNS"
    step "$PYTHON" bench/gpu_suite_report.py --runs "$RUNS" --out "$RESULTS" --iters "$ITERS" \
        --log-interval "$LOG_EVERY" --models "$MODELS" --micro-batch "$MICRO_BATCH" "${profile[@]}" \
        --failed "${failed[@]}"
fi

if (( dry_run )); then
    echo "[gpu_suite] dry run: nothing was run"
elif (( ${#failed[@]} )); then
    echo "[gpu_suite] ${#failed[@]} step(s) failed; see $RESULTS" >&2
    exit 1
else
    echo "[gpu_suite] done: $RESULTS"
fi
