#!/usr/bin/env bash
# Sourced by train-gpt3.sh: MODEL_SIZE_KEY -> MODEL_SIZE (zero-lab's preset) and its NLAYERS, HIDDEN, HEADS.
# The shapes live only in megatron/model/presets.py (MODEL_PRESETS); this file only maps ALCF's key names.

# the drivers' defaults: the tiny preset on CPU ranks, GPT-2 125M on GPUs
if [[ "$ACCELERATOR" == cuda ]]; then MODEL_SIZE_KEY=${MODEL_SIZE_KEY:-GPT125M}
else MODEL_SIZE_KEY=${MODEL_SIZE_KEY:-GPT_TINY}; fi
declare -A ALCF_MODELS=(
    [GPT_TINY]=tiny [GPT125M]=125M [GPT350M]=355M [GPT760M]=760M [GPT774M]=774M [GPT1_3B]=1.3B
    [GPT1_5B]=1.5B [GPT2_7B]=2.7B [GPT6_7B]=6.7B [GPT13B]=13B [GPT25B]=25B [GPT175B]=175B
)
if [[ -z "${ALCF_MODELS[$MODEL_SIZE_KEY]+set}" ]]; then
    zl_die "MODEL_SIZE_KEY=$MODEL_SIZE_KEY is not a known model; valid keys:" \
        "$(printf '%s\n' "${!ALCF_MODELS[@]}" | sort -V | tr '\n' ' ')"
fi
MODEL_SIZE=${ALCF_MODELS[$MODEL_SIZE_KEY]}
read -r NLAYERS HIDDEN HEADS < <("${PYTHON:-python3}" "$REPO_ROOT/megatron/model/presets.py" "$MODEL_SIZE") \
    && [[ -n "$HEADS" ]] || zl_die "MODEL_SIZE_KEY=$MODEL_SIZE_KEY: cannot read preset $MODEL_SIZE from megatron/model/presets.py"
echo "[models] $MODEL_SIZE_KEY: preset $MODEL_SIZE, layers=$NLAYERS hidden=$HIDDEN heads=$HEADS"
