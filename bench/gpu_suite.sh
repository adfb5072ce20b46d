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
# else python3 on PATH: scripts/launch_common.sh); DATA_DIR, DATA_PATH, VOCAB_FILE, MERGE_FILE as the drivers
# read them, WHEELHOUSE (wheelhouse/) where there is no network.
# Before the first run it checks that the GPU, zero-lab's packages and the data are there and stops in one
# line naming what is missing (the dry run prints that line as a note); missing default data is made once
# first where the hub answers.
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
drivers_wanted() { local model; for model in $MODELS; do wanted "$model" && return 0; done; return 1; }

zl_find_python "$REPO"  # the one way every script finds Python; ZL_CUDA_GPUS: the GPUs torch sees
gpus=$ZL_CUDA_GPUS

# What the runs need, checked once before the first, so that a missing piece is one line here rather than
# ten drivers each retrying the hub and failing: the GPU, zero-lab's packages (installed from a wheelhouse
# where there is no network) and the data the drivers read (named as scripts/defaults.sh names it).
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
if ! "$PYTHON" -c 'import deepspeed, megatron.data.helpers' >/dev/null 2>&1; then
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
# Every command goes through `step`: printed, then run unless --dry-run; a failure is recorded.
step() {
    printf '+'; printf ' %q' "$@"; echo
    (( dry_run )) || "$@" || { echo "[gpu_suite] FAILED: $*" >&2; failed+=("$*"); }
}

echo "[gpu_suite] $gpus x $gpu_name: models $MODELS, $ITERS iterations per driver, runs in $RUNS"
# The summary reads every run below SUITE_RUNS: none may be left from an earlier suite.
[[ -n "$only" ]] || step rm -rf "$RUNS"
if (( make_data )); then  # the drivers would make it too, but one at a time and each retrying on failure
    step env DATA_DIR="$DATA_DIR" PYTHON="$PYTHON" bash tools/process_databricks_gpt2.sh
    (( dry_run )) || [[ -f "$DATA_PATH.bin" && -f "$DATA_PATH.idx" ]] \
        || { echo "[gpu_suite] no data in $DATA_DIR: the drivers are skipped" >&2; skip_drivers=1; }
fi
# Checkpoints are not part of the measurement and a 355M one is GBs: --save '' writes none (pretrain_gpt.py
# reads an empty --save as no --save; it comes after the driver's own --save RUN/checkpoints, so it wins).
for model in $MODELS; do
    wanted "$model" && (( ! skip_drivers )) || continue
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
