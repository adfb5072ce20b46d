#!/usr/bin/env bash
# GPT pretraining on dolly with ZeRO stage 3 with CPU offload of optimizer and parameters.
# Settings: environment variables read by examples_zero/common.sh (MODEL_SIZE, SEQ_LEN, MICRO_BATCH,
# GLOBAL_BATCH, TRAIN_ITERS or TRAIN_EPOCHS, NGPUS, LR, DATA_PATH, RUNS_DIR, RUN_NAME, ...);
# extra arguments go to pretrain_gpt.py. Output: ${RUNS_DIR:-runs}/gpt_<model>_Z3_OL/.
zl_driver_stage=3  # a ZERO_STAGE of the environment other than this is refused
EXPERIMENT=Z3_OL
zl_driver_offload=1  # optimizer state and parameters in CPU memory; an OFFLOAD of the environment other than this is refused
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
