#!/usr/bin/env bash
# The main job on a fresh machine: set up, prepare the dolly dataset, run the ZeRO-1
# experiment (GPT-2 125M on the GPUs, or the tiny preset on 2 CPU ranks without a GPU),
# and summarize the run. Everything the experiment takes is overridable by environment
# variables (docs/environment.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
source .venv/bin/activate

# The dolly data is prepared on first use (tools/process_databricks_gpt2.sh): the full corpus from the
# Hugging Face hub, or the committed 382-record sample in data/samples/ when the hub is out of reach.
bash examples_zero/gpt_deepspeed_Z1.sh "$@"
python analysis/summarize.py "${RUNS_DIR:-runs}"
