#!/usr/bin/env bash
# ALCF's args.sh step, now the launch planner's (megatron/launch/alcf.py): the run's name and folder under
# OUTPUT_ROOT, and the Megatron-DeepSpeed flags: batch sizes, parallel sizes, precision, data, optimizer,
# intervals (the training settings the drivers share).
# `bash ALCF/args.sh` prints what it decides for the variables set, as train-gpt3.sh would run it.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../scripts/plan.sh" alcf --show args -- "$@"
