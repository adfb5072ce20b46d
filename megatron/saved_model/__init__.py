"""Saved model weights for use outside a training run: read a zero-lab checkpoint of any ZeRO stage
and TP/PP layout into one full fp32 state dict (`reader.load_checkpoint_weights`), or write one
(`reader.save_checkpoint_weights`). Used by `pretrain_gpt.py --finetune` (megatron/checkpointing/finetune.py) and by
megatron/inference and the conversion tools. Resuming a training run is megatron/checkpointing.py."""
