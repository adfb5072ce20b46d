#!/usr/bin/env bash
# Sourced by train-gpt3.sh: model shape for MODEL_SIZE_KEY -> NLAYERS, HIDDEN, HEADS.

MODEL_SIZE_KEY=${MODEL_SIZE_KEY:-GPT125M}
# key: layers hidden heads (GPT-3 paper shapes, GPT1_5B = GPT-2 XL, GPT_TINY for CPU runs)
declare -A ALCF_MODELS=(
    [GPT_TINY]="2 128 4"
    [GPT125M]="12 768 16"
    [GPT350M]="24 1024 16"
    [GPT760M]="24 1536 16"
    [GPT1_3B]="24 2048 16"
    [GPT1_5B]="48 1536 24"
    [GPT2_7B]="32 2560 32"
    [GPT6_7B]="32 4096 32"
    [GPT13B]="40 5120 64"
    [GPT25B]="64 6144 64"
    [GPT175B]="96 12288 96"
)
if [[ -z "${ALCF_MODELS[$MODEL_SIZE_KEY]+set}" ]]; then
    echo "error: MODEL_SIZE_KEY=$MODEL_SIZE_KEY is not a known model; valid keys:" \
        "$(printf '%s\n' "${!ALCF_MODELS[@]}" | sort -V | tr '\n' ' ')" >&2
    exit 1
fi
read -r NLAYERS HIDDEN HEADS <<< "${ALCF_MODELS[$MODEL_SIZE_KEY]}"
echo "[models] $MODEL_SIZE_KEY: layers=$NLAYERS hidden=$HIDDEN heads=$HEADS"
