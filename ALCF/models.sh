#!/usr/bin/env bash
# ALCF's models.sh step, now the launch planner's (megatron/launch/alcf.py): MODEL_SIZE_KEY -> zero-lab's preset
# (megatron/model/presets.py holds the shapes) and its layers, hidden size and heads.
# `bash ALCF/models.sh` prints what it decides for the variables set, as train-gpt3.sh would run it.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../scripts/plan.sh" alcf --show models -- "$@"
