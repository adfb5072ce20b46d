"""Convert a Hugging Face GPT-2 (gpt2, -medium, -large, -xl shapes) or Llama folder into a zero-lab checkpoint.

    python tools/hf_to_checkpoint.py --hf /models/gpt2 --save runs/gpt2_init
    python pretrain_gpt.py --model-size 125M --seq-length 1024 --load runs/gpt2_init --finetune ...

The checkpoint is at iteration 0 with no optimizer state; `--finetune` loads only its weights,
whatever the ZeRO stage of the run. vocab.json/merges.txt are copied next to it when a GPT-2 folder has them; a
Llama's run gives its own --tokenizer-type and --tokenizer-model. What a Llama config needs: docs/model.md.
"""
from __future__ import annotations

import argparse
import sys

from megatron.errors import ZeroLabError
from megatron.inference.hf_flags import model_flags
from megatron.inference.hf_folder import load_hf_folder
from megatron.saved_model.reader import save_checkpoint_weights


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--hf", required=True, help="folder with config.json and model.safetensors (or .bin)")
    parser.add_argument("--save", required=True, help="checkpoint folder to write (must not exist or be empty)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary as pretrain_gpt.py will (default 128)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    try:
        loaded = load_hf_folder(args.hf, args.make_vocab_size_divisible_by)
        gpt2_bpe = loaded.tokenizer is not None and loaded.tokenizer.tokenizer_type == "GPT2BPETokenizer"
        files = {"vocab_file": loaded.tokenizer.vocab_file, "merge_file": loaded.tokenizer.merge_file} \
            if gpt2_bpe else {}
        save_checkpoint_weights(args.save, loaded.config, loaded.state_dict, files, source=f"hf:{args.hf}")
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    c = loaded.config
    print(f"wrote {args.save} from {args.hf}: {' '.join(model_flags(c))} --max-position-embeddings "
          f"{c.max_position_embeddings} (padded vocab {c.padded_vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
