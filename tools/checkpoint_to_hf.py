"""Export a zero-lab checkpoint (any ZeRO stage, TP/PP layout, offload included) as a Hugging Face folder.

    python tools/checkpoint_to_hf.py --load runs/gpt_125M_Z3/checkpoints --output hf/gpt_125M

The folder (config.json, model.safetensors and the tokenizer's files: tokenizer.json and tokenizer_config.json
written by transformers' tokenizer class, with the run's own vocab.json and merges.txt for GPT-2's tokenizer,
tokenizer.model for Llama2Tokenizer, original/tokenizer.model for Llama3Tokenizer) loads offline with
transformers.AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained: GPT2LMHeadModel for a GPT-2
shaped model, LlamaForCausalLM for a Llama-shaped one (docs/model.md), and tools/generate_text.py --hf reads it
with no tokenizer flag. The padded vocabulary rows are dropped when the tokenizer is known.
"""
from __future__ import annotations

import argparse
import sys

from megatron.errors import ZeroLabError
from megatron.inference.hf_folder import save_hf_folder
from megatron.inference.tokenizer_files import resolve_tokenizer
from megatron.saved_model.reader import load_checkpoint_weights


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint folder (holding 'latest') or one tag folder")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step100 (default: latest)")
    parser.add_argument("--output", required=True, help="Hugging Face folder to write (must not exist or be empty)")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: the one the run used)")
    parser.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: the one the run used)")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle any object the checkpoint holds (it can run code; docs/checkpoints.md)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    try:
        loaded = load_checkpoint_weights(args.load, args.tag, trust=args.trust_checkpoint)
        tokenizer, tokenizer_config = resolve_tokenizer(loaded.tokenizer, args.vocab_file, args.merge_file)
        vocab_size = tokenizer.vocab_size if tokenizer else loaded.config.padded_vocab_size
        save_hf_folder(loaded, args.output, vocab_size, tokenizer, tokenizer_config)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} from {loaded.path} (iteration {loaded.iteration}, {loaded.config.num_layers} layers, "
          f"hidden {loaded.config.hidden_size}, vocab {vocab_size}; weights: {loaded.weights_from})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
