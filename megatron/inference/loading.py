"""One call for the inference tools: a checkpoint (--load) or an HF folder (--hf) as a model plus tokenizer."""
from __future__ import annotations

import argparse

import torch

from megatron.inference.tokenizer_files import resolve_tokenizer
from megatron.saved_model.reader import LoadedCheckpoint, SavedModelError, build_model, load_checkpoint_weights


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="zero-lab checkpoint folder (holding 'latest'), any ZeRO stage")
    source.add_argument("--hf", help="Hugging Face GPT-2 or Llama folder (config.json, model.safetensors and the "
                                     "tokenizer's files, as tools/checkpoint_to_hf.py writes it)")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step100 (default: latest)")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: the one the checkpoint names)")
    parser.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: the one the checkpoint names)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle any object the checkpoint holds (it can run code; docs/checkpoints.md)")


def load_model_and_tokenizer(args: argparse.Namespace):
    """(LoadedCheckpoint, GPTModel in eval mode on args.device, tokenizer)."""
    if args.hf is not None:
        import transformers

        from megatron.inference.hf_folder import load_hf_folder
        transformers.utils.logging.disable_progress_bar()
        loaded: LoadedCheckpoint = load_hf_folder(args.hf)
    else:
        loaded = load_checkpoint_weights(args.load, args.tag, trust=args.trust_checkpoint)
    tokenizer, _ = resolve_tokenizer(loaded.tokenizer, args.vocab_file, args.merge_file)
    if tokenizer is None:
        raise SavedModelError(f"{loaded.path}: no usable tokenizer recorded (a GPT-2 vocab.json and merges.txt, a "
                              "Llama tokenizer.model); give --vocab-file and --merge-file")
    if tokenizer.vocab_size > loaded.config.padded_vocab_size:
        raise SavedModelError(f"{loaded.path}: the tokenizer has {tokenizer.vocab_size} ids but the model only "
                              f"{loaded.config.padded_vocab_size}; wrong --vocab-file?")
    return loaded, build_model(loaded.config, loaded.state_dict, args.device), tokenizer
