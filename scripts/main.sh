#!/usr/bin/env bash
# The main job on a fresh machine: set up, prepare the dolly dataset, run the ZeRO-1
# experiment (GPT-2 125M on the GPUs, or the tiny preset on 2 CPU ranks without a GPU),
# and summarize the run. Everything the experiment takes is overridable by environment
# variables (see examples_zero/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
source .venv/bin/activate

# The full dolly corpus comes from the Hugging Face hub. Where the hub is out of reach and
# no copy was provided, fall back to the real 382-record sample committed in data/samples/.
sample=data/samples/dolly-sample.jsonl
if [[ -z "${DOLLY_JSONL:-}" && ! -f data/databricks-dolly-15k.jsonl && -f "$sample" ]] \
    && ! curl -sfI --max-time 10 https://huggingface.co >/dev/null 2>&1; then
    echo "[main] Hugging Face hub unreachable: using the dolly sample $sample"
    export DOLLY_JSONL=$sample
fi

bash examples_zero/gpt_deepspeed_Z1.sh "$@"
python analysis/summarize.py "${RUNS_DIR:-runs}"
