#!/usr/bin/env bash
# GPT pretraining on dolly, one experiment: ZeRO stage 3; optimizer states and parameters offloaded to
# CPU memory (OFFLOAD=1).
# Settings: the environment variables of docs/environment.md (MODEL_SIZE, SEQ_LEN, MICRO_BATCH, GLOBAL_BATCH,
# TRAIN_ITERS or TRAIN_EPOCHS, NGPUS, LR, DATA_PATH, RUNS_DIR, RUN_NAME, ...); another ZERO_STAGE or OFFLOAD is
# refused. Extra arguments go to pretrain_gpt.py last. Output: ${RUNS_DIR:-runs}/gpt_<model>_Z3_OL/.
# The launch planner (megatron/launch/drivers.py) holds this experiment's stage and offload.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../scripts/plan.sh" driver Z3_OL -- "$@"
