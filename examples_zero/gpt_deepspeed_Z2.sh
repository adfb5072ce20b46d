#!/usr/bin/env bash
# GPT pretraining on dolly with ZeRO stage 2.
# Settings: environment variables read by examples_zero/common.sh (MODEL_SIZE, SEQ_LEN, MICRO_BATCH,
# GLOBAL_BATCH, TRAIN_ITERS or TRAIN_EPOCHS, NGPUS, LR, DATA_PATH, RUNS_DIR, RUN_NAME, ...);
# extra arguments go to pretrain_gpt.py. Output: ${RUNS_DIR:-runs}/gpt_<model>_Z2/.
zl_driver_stage=2  # a ZERO_STAGE of the environment other than this is refused
EXPERIMENT=Z2
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
