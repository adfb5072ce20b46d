#!/usr/bin/env bash
# GPT pretraining on dolly with ZeRO stage 3, optimizer states and parameters offloaded to NVMe
# (ZeRO-Infinity) through DeepSpeed's async I/O; the files go to NVME_PATH (default: <run>/nvme).
# Settings: environment variables read by examples_zero/common.sh (MODEL_SIZE, SEQ_LEN, MICRO_BATCH,
# GLOBAL_BATCH, TRAIN_ITERS or TRAIN_EPOCHS, NGPUS, LR, DATA_PATH, RUNS_DIR, RUN_NAME, NVME_PATH, ...);
# extra arguments go to pretrain_gpt.py. Output: ${RUNS_DIR:-runs}/gpt_<model>_Z3_NVMe/.
zl_driver_stage=3  # a ZERO_STAGE of the environment other than this is refused
EXPERIMENT=Z3_NVMe
zl_driver_offload=nvme  # optimizer state and parameters in files under NVME_PATH; another OFFLOAD is refused
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
