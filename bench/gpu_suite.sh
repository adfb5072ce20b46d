#!/usr/bin/env bash
# The GPU acceptance run (docs/gpu.md): on every visible GPU, GPT-2 125M and 355M at seq 1024 in
# bf16, the five ZeRO drivers (DP, Z1, Z2, Z3, Z3_OL) for SUITE_ITERS iterations each, then
# analysis/summarize.py over those runs (MFU from the GPU's peak), then bench/bench_gpt_vs_hf.py
# on CUDA in bf16 without and with --compile. About 15 minutes on one H100.
#
# Usage: bash bench/gpu_suite.sh [--dry-run] [--only PARTS]
#   --dry-run     print every command, run none (works without a GPU)
#   --only PARTS  comma-separated parts of the suite: a model (125M, 355M: its five drivers), bench,
#                 report (the summary and the results page); for machines that run one command for
#                 at most a few minutes. Without it all parts run, after emptying SUITE_RUNS.
# Writes bench/results/<gpu-name>.md (machine, versions, settings, the tables; "<count>x-" before
# the name with several GPUs) and <gpu-name>-summary.{csv,json} beside it; the runs, the full
# summary and its plots stay in SUITE_RUNS (runs/gpu_suite, emptied first). Settings: SUITE_MODELS ("125M 355M"),
# SUITE_ITERS (60), SUITE_RUNS, MICRO_BATCH (8; the drivers' GPU default), PYTHON (default the repo's .venv,
# else python3 on PATH: scripts/launch_common.sh).
# Exit status: 0 when every step passed, 1 when one failed (the others still run; the results
# file names the failed steps).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
source scripts/launch_common.sh
MODELS=${SUITE_MODELS:-125M 355M}
ITERS=${SUITE_ITERS:-60}
RUNS=${SUITE_RUNS:-$REPO/runs/gpu_suite}
MICRO_BATCH=${MICRO_BATCH:-8}

usage="usage: bench/gpu_suite.sh [--dry-run] [--only PARTS]"
dry_run=0 only=""
while (( $# )); do
    case "$1" in
        --dry-run) dry_run=1; shift ;;
        --only) [[ $# -ge 2 ]] || zl_die "--only needs a list such as 125M,bench ($usage)"
                only=$2; shift 2 ;;
        *) zl_die "unknown argument $1 ($usage)" ;;
    esac
done
for part in ${only//,/ }; do
    [[ " $MODELS bench report " == *" $part "* ]] \
        || zl_die "--only $only: unknown part $part (expected: ${MODELS// /, }, bench, report)"
done
wanted() { [[ -z "$only" || ",$only," == *",$1,"* ]]; }

zl_find_python "$REPO"  # the one way every script finds Python; ZL_CUDA_GPUS: the GPUs torch sees
gpus=$ZL_CUDA_GPUS
if (( gpus > 0 )); then
    gpu_name=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")
elif (( dry_run )); then
    gpus=1 gpu_name="no GPU (dry run)"
else
    zl_die "no CUDA GPU visible to torch (torch.cuda.device_count() is 0): the GPU suite needs one;" \
        "--dry-run prints its commands"
fi
slug=$(tr '[:upper:]' '[:lower:]' <<< "$gpu_name" | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')
(( gpus == 1 )) || slug="${gpus}x-$slug"
RESULTS=$REPO/bench/results/$slug.md

failed=()
# Every command goes through `step`: printed, then run unless --dry-run; a failure is recorded.
step() {
    printf '+'; printf ' %q' "$@"; echo
    (( dry_run )) || "$@" || { echo "[gpu_suite] FAILED: $*" >&2; failed+=("$*"); }
}

echo "[gpu_suite] $gpus x $gpu_name: models $MODELS, $ITERS iterations per driver, runs in $RUNS"
# The summary reads every run below SUITE_RUNS: none may be left from an earlier suite.
[[ -n "$only" ]] || step rm -rf "$RUNS"
# Checkpoints are not part of the measurement and a 355M one is GBs: --save '' writes none.
for model in $MODELS; do
    wanted "$model" || continue
    for experiment in DP Z1 Z2 Z3 Z3_OL; do
        step env RUNS_DIR="$RUNS" MODEL_SIZE="$model" SEQ_LEN=1024 PRECISION=bf16 MICRO_BATCH="$MICRO_BATCH" \
            NGPUS="$gpus" TRAIN_ITERS="$ITERS" LOG_INTERVAL=10 EVAL_INTERVAL="$ITERS" EVAL_ITERS=2 \
            PYTHON="$PYTHON" bash examples_zero/gpt_deepspeed_$experiment.sh --save ''
    done
done

# GPT-2 125M's shape; one stage with --compile (each engine compiles anew, which takes minutes).
bench_shape=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
             --micro-batch-size "$MICRO_BATCH" --gradient-accumulation 1 --bf16)
launch=("$PYTHON" -m torch.distributed.run --nproc_per_node "$gpus" --master_port 29510)
if wanted bench; then
    (( dry_run )) || mkdir -p "$RUNS"
    step "${launch[@]}" bench/bench_gpt_vs_hf.py "${bench_shape[@]}" --json "$RUNS/bench_gpt_vs_hf.json"
    step "${launch[@]}" bench/bench_gpt_vs_hf.py "${bench_shape[@]}" --stages 1 --compile \
        --json "$RUNS/bench_gpt_vs_hf_compile.json"
fi
if wanted report; then
    step "$PYTHON" analysis/summarize.py "$RUNS"
    step "$PYTHON" bench/gpu_suite_report.py --runs "$RUNS" --out "$RESULTS" --iters "$ITERS" \
        --models "$MODELS" --micro-batch "$MICRO_BATCH" --failed "${failed[@]}"
fi

if (( dry_run )); then
    echo "[gpu_suite] dry run: nothing was run"
elif (( ${#failed[@]} )); then
    echo "[gpu_suite] ${#failed[@]} step(s) failed; see $RESULTS" >&2
    exit 1
else
    echo "[gpu_suite] done: $RESULTS"
fi
