# Training defaults shared by both launch paths, examples_zero/common.sh and ALCF/args.sh (sourced by
# them, never run). Every value is an environment variable the user can set first; the flags they make
# are collected in TRAINING_DEFAULT_FLAGS, which both paths pass to pretrain_gpt.py.

ZERO_LAB_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DATA_DIR=${DATA_DIR:-$ZERO_LAB_ROOT/data}
DATA_PATH=${DATA_PATH:-$DATA_DIR/dolly_text_document}  # one prefix, or "weight prefix weight prefix ..."
VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$DATA_DIR/gpt2-merges.txt}
SPLIT=${SPLIT:-${DATA_SPLIT:-969,30,1}}  # DATA_SPLIT: ALCF's name
# GPT-3 paper optimizer: cosine decay to a tenth of the peak after 1% warm-up, AdamW betas (0.9, 0.95),
# weight decay 0.1, gradients clipped at norm 1.
LR=${LR:-6.0e-4}
MIN_LR=${MIN_LR:-6.0e-5}
LR_DECAY_STYLE=${LR_DECAY_STYLE:-cosine}
LR_WARMUP_FRACTION=${LR_WARMUP_FRACTION:-${LR_WARMUP_FRAC:-0.01}}  # LR_WARMUP_FRAC: ALCF's name
ADAM_BETA1=${ADAM_BETA1:-0.9}
ADAM_BETA2=${ADAM_BETA2:-0.95}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.1}
CLIP_GRAD=${CLIP_GRAD:-1.0}
SEED=${SEED:-1234}
# a collective that waits longer than this ends the run (a lost host) instead of hanging; Megatron's default
DISTRIBUTED_TIMEOUT_MINUTES=${DISTRIBUTED_TIMEOUT_MINUTES:-10}

read -r -a DATA_PATH_WORDS <<< "$DATA_PATH"
TRAINING_DEFAULT_FLAGS=(
    --data-path "${DATA_PATH_WORDS[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split "$SPLIT"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style "$LR_DECAY_STYLE" --lr-warmup-fraction "$LR_WARMUP_FRACTION"
    --adam-beta1 "$ADAM_BETA1" --adam-beta2 "$ADAM_BETA2" --weight-decay "$WEIGHT_DECAY" --clip-grad "$CLIP_GRAD"
    --seed "$SEED" --distributed-timeout-minutes "$DISTRIBUTED_TIMEOUT_MINUTES"
)
# flag=VARIABLE for each flag above: an error about the flag names the variable (megatron/launch/flag_sources.py)
TRAINING_DEFAULT_SOURCES="--data-path=DATA_PATH --vocab-file=VOCAB_FILE --merge-file=MERGE_FILE --split=SPLIT
    --lr=LR --min-lr=MIN_LR --lr-decay-style=LR_DECAY_STYLE --lr-warmup-fraction=LR_WARMUP_FRACTION
    --adam-beta1=ADAM_BETA1 --adam-beta2=ADAM_BETA2 --weight-decay=WEIGHT_DECAY --clip-grad=CLIP_GRAD --seed=SEED
    --distributed-timeout-minutes=DISTRIBUTED_TIMEOUT_MINUTES"
