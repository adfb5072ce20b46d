"""Inference-side loading: checkpoints of any ZeRO stage or Hugging Face GPT-2 folders as one
GPTModel, text generation with a key/value cache. Used by tools/{checkpoint_to_hf, hf_to_checkpoint,
generate_text, eval_dolly}.py and by `pretrain_gpt.py --finetune`."""
