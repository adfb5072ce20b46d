#!/usr/bin/env bash
# Prepare databricks-dolly-15k for GPT-2 training:
#   $DATA_DIR/dolly_text_document.{bin,idx}  (one document per record, each ending with eod 50256)
#
# Environment (all optional):
#   DATA_DIR     output folder (default <repo>/data)
#   DOLLY_JSONL  the dolly jsonl (default $DATA_DIR/databricks-dolly-15k.jsonl, downloaded from the hub if absent,
#                else the committed sample data/samples/dolly-sample.jsonl)
#   VOCAB_FILE, MERGE_FILE  GPT-2 vocab.json / merges.txt (default $DATA_DIR/gpt2-vocab.json, gpt2-merges.txt,
#                fetched from the hub, or converted from the openai-whisper sdist on PyPI by tools/gpt2_vocab.py)
#   PYTHON       interpreter (default the repo's .venv, else python3 on PATH: scripts/find_python.sh);
#   WORKERS      tokenizer processes (default nproc, at most 8)
#   HF_HUB_OFFLINE=1 skips every Hugging Face download.
# Safe to run again: the data is rebuilt only when its sidecar (dolly_text_document.meta.json) says it
# was made from other text or another vocabulary, or an input is newer than it.
# SIGTERM/SIGINT stop the running child and remove temporary files (exit 143/130).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DATA_DIR=${DATA_DIR:-$REPO/data}
source "$REPO/scripts/find_python.sh"
zl_find_python "$REPO"  # the one way every script finds Python (and REPO on PYTHONPATH)
zl_require_torch
# dolly is ~13 MB (about 13 one-MB chunks): more than 8 workers would mostly fork idle processes.
WORKERS=${WORKERS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}
HUB=https://huggingface.co
DOLLY_URL=$HUB/datasets/databricks/databricks-dolly-15k/resolve/main/databricks-dolly-15k.jsonl

say() { echo "[dolly] $*"; }

# Children run in the background and are waited for: bash runs a trap only between commands, so
# a foreground child would hold SIGTERM back until it finished on its own.
# A child that fails is named when a signal killed it (e.g. SIGKILL from the out-of-memory killer),
# and the temporary files it could not remove are removed.
child=
run_child() {
    local status=0
    "$@" & child=$!
    wait "$child" || status=$?
    if (( status != 0 )); then
        rm -f "$DATA_DIR"/*.tmp-"$child"
        local name=${1##*/}
        [[ $name != python* ]] || name=${2##*/}
        (( status <= 128 )) || echo "error: $name was killed by SIG$(kill -l "$status")" >&2
    fi
    return "$status"
}
on_signal() {
    trap - TERM INT
    if [[ -n $child ]]; then
        kill -TERM "$child" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
    # The python tools remove their own temporary files on SIGTERM; these are what a harder end leaves.
    rm -f "$DATA_DIR"/*.tmp-"${child:-none}" "$DATA_DIR"/*.tmp-$$
    echo "error: stopped by SIG$1; temporary files removed" >&2
    exit $((128 + $(kill -l "$1")))
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
# newer_than TARGET FILE...: true when any FILE is newer than TARGET (or TARGET is missing).
newer_than() {
    local target=$1 file; shift
    for file in "$@"; do [[ -f $target && ! $file -nt $target ]] || return 0; done
    return 1
}

# fetch URL DEST: download to a temporary name and rename, so a failed download leaves nothing. curl's own
# error line is not printed: it goes into fetch_error, which the line saying what happens instead names once.
fetch_error=
fetch() {
    fetch_error="HF_HUB_OFFLINE=1"
    [[ "${HF_HUB_OFFLINE:-0}" == 1 ]] && return 1
    fetch_error="no curl on PATH"
    command -v curl >/dev/null 2>&1 || return 1
    local errors=$DATA_DIR/fetch-errors.tmp-$$  # a name the signal handler removes
    if run_child curl --fail --silent --show-error --location --connect-timeout 10 \
            --max-time "${DOWNLOAD_TIMEOUT:-120}" -o "$2.tmp-$$" "$1" 2>"$errors"; then
        rm -f "$errors"
        mv "$2.tmp-$$" "$2"
        return 0
    fi
    fetch_error=$(tr '\n' ' ' <"$errors" | sed 's/ *$//')
    rm -f "$2.tmp-$$" "$errors"
    fetch_error=${fetch_error:-curl failed}
    return 1
}

# The output folder must take files before anything is downloaded or tokenized (a probe file, not
# permissions: root passes those even on a read-only filesystem).
{ mkdir -p "$DATA_DIR" && probe=$(mktemp "$DATA_DIR/.write-probe.XXXXXX") && rm -f "$probe"; } 2>/dev/null \
    || zl_die "DATA_DIR=$DATA_DIR: cannot create or write to this folder"

# 1. The dolly records.
default_dolly=$DATA_DIR/databricks-dolly-15k.jsonl
if [[ -n "${DOLLY_JSONL:-}" ]]; then
    [[ -f "$DOLLY_JSONL" ]] || zl_die "DOLLY_JSONL=$DOLLY_JSONL: file not found"
elif [[ -f "$default_dolly" ]]; then
    DOLLY_JSONL=$default_dolly
else
    [[ "${HF_HUB_OFFLINE:-0}" == 1 ]] || say "downloading $DOLLY_URL"
    if fetch "$DOLLY_URL" "$default_dolly"; then
        DOLLY_JSONL=$default_dolly
    else
        # Offline: the real 382-record sample committed with the repository (data/samples/README.md).
        DOLLY_JSONL=$REPO/data/samples/dolly-sample.jsonl
        say "the Hugging Face hub is out of reach ($fetch_error): using the committed dolly sample $DOLLY_JSONL" \
            "(382 records; for the full corpus give DOLLY_JSONL=/path/to/databricks-dolly-15k.jsonl" \
            "or put it at $default_dolly)"
    fi
fi

# 2. The GPT-2 vocabulary.
if [[ -n "${VOCAB_FILE:-}" || -n "${MERGE_FILE:-}" ]]; then
    [[ -f "${VOCAB_FILE:-}" ]] || zl_die "VOCAB_FILE=${VOCAB_FILE:-}: file not found (give VOCAB_FILE and MERGE_FILE together)"
    [[ -f "${MERGE_FILE:-}" ]] || zl_die "MERGE_FILE=${MERGE_FILE:-}: file not found (give VOCAB_FILE and MERGE_FILE together)"
else
    VOCAB_FILE=$DATA_DIR/gpt2-vocab.json
    MERGE_FILE=$DATA_DIR/gpt2-merges.txt
    if [[ ! -f "$VOCAB_FILE" || ! -f "$MERGE_FILE" ]]; then
        if fetch $HUB/gpt2/resolve/main/vocab.json "$VOCAB_FILE" && fetch $HUB/gpt2/resolve/main/merges.txt "$MERGE_FILE"; then
            say "downloaded the GPT-2 vocabulary from the hub"
        else
            rm -f "$VOCAB_FILE" "$MERGE_FILE"
            say "GPT-2 vocabulary not on the hub from here ($fetch_error): converting it from PyPI (tools/gpt2_vocab.py)"
            run_child "$PYTHON" "$REPO/tools/gpt2_vocab.py" --output-dir "$DATA_DIR" --verify-text "$DOLLY_JSONL"
        fi
    fi
fi

# 3. Text per record (dolly_to_text.py leaves the file untouched when its text is the same), then
#    tokenize unless the sidecar says the data was made from this text with this vocabulary.
prefix=$DATA_DIR/dolly_text_document
text_jsonl=$DATA_DIR/dolly_text.jsonl
tokenizer=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
run_child "$PYTHON" "$REPO/tools/dolly_to_text.py" --input "$DOLLY_JSONL" --output "$text_jsonl"
if stale=$("$PYTHON" -m megatron.data.dataset_sidecar "$prefix" --source "$text_jsonl" "${tokenizer[@]}") \
        && ! newer_than "$prefix.bin" "$DOLLY_JSONL" "$VOCAB_FILE" "$MERGE_FILE" \
        && ! newer_than "$prefix.idx" "$DOLLY_JSONL" "$VOCAB_FILE" "$MERGE_FILE"; then
    say "up to date: $prefix.{bin,idx} were made from $DOLLY_JSONL and this vocabulary (delete them to rebuild)"
else
    [[ -z $stale || ! -f $prefix.idx ]] || say "rebuilding: ${stale#stale: }"
    run_child "$PYTHON" "$REPO/tools/preprocess_data.py" --input "$text_jsonl" --json-keys text \
        --output-prefix "$DATA_DIR/dolly" "${tokenizer[@]}" --append-eod --workers "$WORKERS"
fi
"$PYTHON" -c "import sys; from megatron.data.indexed_dataset import MMapIndexedDataset as D; \
d = D(sys.argv[1]); print(f'[dolly] {sys.argv[1]}: {len(d.doc_idx) - 1} documents, {int(d.sizes.sum())} tokens')" "$prefix"
