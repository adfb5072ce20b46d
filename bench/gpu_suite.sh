#!/usr/bin/env bash
# The GPU acceptance run (docs/gpu.md): on every visible GPU, GPT-2 125M and 355M at seq 1024 in
# bf16, the five ZeRO drivers (DP, Z1, Z2, Z3, Z3_OL) for SUITE_ITERS iterations each, then
# analysis/summarize.py over those runs (MFU from the GPU's peak), then bench/bench_gpt_vs_hf.py
# on CUDA in bf16 without and with --compile. About 15 minutes on one H100.
#
# Usage: bash bench/gpu_suite.sh [--dry-run]
#   --dry-run  print every command, run none (works without a GPU)
# Writes bench/results/<gpu-name>.md (machine, versions, settings, the tables; "<count>x-" before
# the name with several GPUs) and <gpu-name>-summary.{csv,json} beside it; the runs, the full
# summary and its plots stay in SUITE_RUNS (runs/gpu_suite, emptied first). Settings: SUITE_MODELS ("125M 355M"),
# SUITE_ITERS (60), SUITE_RUNS, MICRO_BATCH (8; the drivers' GPU default), PYTHON (python3 on PATH).
# Exit status: 0 when every step passed, 1 when one failed (the others still run; the results
# file names the failed steps).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-$(command -v python3)}
MODELS=${SUITE_MODELS:-125M 355M}
ITERS=${SUITE_ITERS:-60}
RUNS=${SUITE_RUNS:-$REPO/runs/gpu_suite}
MICRO_BATCH=${MICRO_BATCH:-8}
die() { echo "error: $*" >&2; exit 1; }

dry_run=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        *) die "unknown argument $arg (usage: bench/gpu_suite.sh [--dry-run])" ;;
    esac
done

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())") || die "PYTHON=$PYTHON cannot import torch"
if (( gpus > 0 )); then
    gpu_name=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")
elif (( dry_run )); then
    gpus=1 gpu_name="no GPU (dry run)"
else
    die "no CUDA GPU visible to torch (torch.cuda.device_count() is 0): the GPU suite needs one; --dry-run prints its commands"
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
step rm -rf "$RUNS"  # the summary reads every run below it: none may be left from an earlier suite
# Checkpoints are not part of the measurement and a 355M one is GBs: --save '' writes none.
for model in $MODELS; do
    for experiment in DP Z1 Z2 Z3 Z3_OL; do
        step env RUNS_DIR="$RUNS" MODEL_SIZE="$model" SEQ_LEN=1024 PRECISION=bf16 MICRO_BATCH="$MICRO_BATCH" \
            NGPUS="$gpus" TRAIN_ITERS="$ITERS" LOG_INTERVAL=10 EVAL_INTERVAL="$ITERS" EVAL_ITERS=2 \
            PYTHON="$PYTHON" bash examples_zero/gpt_deepspeed_$experiment.sh --save ''
    done
done
step "$PYTHON" analysis/summarize.py "$RUNS"

# GPT-2 125M's shape; one stage with --compile (each engine compiles anew, which takes minutes).
bench_shape=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
             --micro-batch-size "$MICRO_BATCH" --gradient-accumulation 1 --bf16)
launch=("$PYTHON" -m torch.distributed.run --nproc_per_node "$gpus" --master_port 29510)
step "${launch[@]}" bench/bench_gpt_vs_hf.py "${bench_shape[@]}" --json "$RUNS/bench_gpt_vs_hf.json"
step "${launch[@]}" bench/bench_gpt_vs_hf.py "${bench_shape[@]}" --stages 1 --compile \
    --json "$RUNS/bench_gpt_vs_hf_compile.json"
step "$PYTHON" bench/gpu_suite_report.py --runs "$RUNS" --out "$RESULTS" --iters "$ITERS" --failed "${failed[@]}"

if (( dry_run )); then
    echo "[gpu_suite] dry run: nothing was run"
elif (( ${#failed[@]} )); then
    echo "[gpu_suite] ${#failed[@]} step(s) failed; see $RESULTS" >&2
    exit 1
else
    echo "[gpu_suite] done: $RESULTS"
fi
