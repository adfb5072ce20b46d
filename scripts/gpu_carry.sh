#!/usr/bin/env bash
# Usage: bash scripts/gpu_carry.sh [DIR] [--present FILE] [--python-version X.Y]
# On a machine with package access: everything the quick GPU acceptance run (bash bench/gpu_suite.sh
# --quick, docs/gpu.md) needs beside the repository on a GPU machine without network that already has a
# CUDA torch, in one folder (default gpu_carry/, git-ignored) of at most 48 MiB:
#   DIR/wheelhouse/  zero-lab's wheels without torch and without the [test] extra, for CPython X.Y (default
#                    3.12), less what the target has (--present: its `pip list --format=freeze`, or names
#                    alone): scripts/wheelhouse.sh --no-test
#   DIR/data/        the tokenized dolly text and the GPT-2 vocabulary: tools/process_databricks_gpt2.sh
#                    (the full dolly where the hub answers or DOLLY_JSONL names it, else the committed sample)
# The folder is filled under a temporary name and renamed when complete and within the size: a DIR that
# exists is whole. Without --present the wheelhouse holds numpy, transformers, matplotlib and the rest, and
# is larger than the limit: the script then stops in one line saying so.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LIMIT_MIB=48
die() { echo "error: $*" >&2; exit 1; }

usage="usage: scripts/gpu_carry.sh [DIR] [--present FILE] [--python-version X.Y]"
dir="" present=() python_version=3.12
while (( $# )); do
    case "$1" in
        --present) [[ $# -ge 2 && -f "${2:-}" ]] || die "--present ${2:-}: no such file ($usage)"
                   present=(--present "$(realpath "$2")"); shift 2 ;;
        --python-version) [[ $# -ge 2 ]] || die "--python-version needs a value such as 3.12"
                          python_version=$2; shift 2 ;;
        -*) die "unknown option $1 ($usage)" ;;
        *) [[ -z "$dir" ]] || die "one folder expected, got '$dir' and '$1'"; dir=$1; shift ;;
    esac
done
dir=$(realpath -m "${dir:-$REPO/gpu_carry}")

mkdir -p "$(dirname "$dir")"
tmp=$(mktemp -d "$dir.partial.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
bash "$REPO/scripts/wheelhouse.sh" "$tmp/wheelhouse" --python-version "$python_version" --no-test "${present[@]}"
# The drivers read these four files (megatron/launch/settings.py's DATA_PATH, VOCAB_FILE, MERGE_FILE under DATA_DIR);
# the sidecar (PREFIX.meta.json) says what the data was made from.
DATA_DIR=$tmp/data bash "$REPO/tools/process_databricks_gpt2.sh"
for file in dolly_text_document.bin dolly_text_document.idx gpt2-vocab.json gpt2-merges.txt; do
    [[ -s "$tmp/data/$file" ]] || die "tools/process_databricks_gpt2.sh left no $file in $tmp/data"
done
# Only what the run reads travels: the dolly jsonl the data was made from stays here.
find "$tmp/data" -maxdepth 1 -type f ! -name 'dolly_text_document.*' ! -name 'gpt2-*' -delete
size=$(du -sb "$tmp" | cut -f1)
mib=$(( (size + 2**20 - 1) / 2**20 ))
(( mib <= LIMIT_MIB )) || die "the carry folder would be $mib MiB, over its $LIMIT_MIB MiB: name the target's" \
    "packages with --present FILE (its 'python3 -m pip list --format=freeze'), so that the wheelhouse leaves them out"
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "[gpu_carry] $dir: $mib MiB ($(ls "$dir/wheelhouse" | wc -l) wheels, data $(du -sh "$dir/data" | cut -f1))"
