"""Using a trained model: load it (with its tokenizer) for generation and evaluation, convert to and from
Hugging Face GPT-2 folders, generate text with a key/value cache. Used by tools/{checkpoint_to_hf,
hf_to_checkpoint, generate_text, eval_dolly}.py; training code never imports this package."""
