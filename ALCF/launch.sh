#!/usr/bin/env bash
# ALCF's launch.sh step, now the launch planner's (megatron/launch/alcf.py): the mpiexec line (PALS, MPICH's
# Hydra or Open MPI, from `mpiexec --version`) that train-gpt3.sh runs.
# `bash ALCF/launch.sh` prints what it decides for the variables set, as train-gpt3.sh would run it.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../scripts/plan.sh" alcf --show launch -- "$@"
