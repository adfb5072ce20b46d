"""Generate text from a zero-lab checkpoint (any ZeRO stage) or a Hugging Face GPT-2 or Llama folder.

    python tools/generate_text.py --load runs/gpt_tiny_Z1/checkpoints --prompt "The capital of France" --greedy
    python tools/generate_text.py --hf hf/llama_tiny --prompt-file prompts.txt --top-p 0.9 --temperature 0.8
    echo "Once upon a time" | python tools/generate_text.py --load runs/gpt_tiny_Z1/checkpoints

Prompts: --prompt (repeatable), --prompt-file (one prompt per non-empty line), else all of stdin
as one prompt. Each prompt and its continuation go to stdout, followed by a line
`--- end of sample N ---`; generation speed (tokens/s) goes to stderr. Generation stops at
--max-new-tokens or after the end-of-document token.
"""
from __future__ import annotations

import argparse
import sys

import torch

from megatron.errors import ZeroLabError
from megatron.inference.generation import GenerationError, SamplingConfig, generate
from megatron.inference.loading import add_model_flags, load_model_and_tokenizer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_model_flags(parser)
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    prompts.add_argument("--prompt-file", help="one prompt per non-empty line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (ignores the sampling flags)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole prefix at every step")
    return parser.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as handle:
                prompts = [line.rstrip("\n") for line in handle if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            raise GenerationError(f"--prompt-file {args.prompt_file}: cannot read ({err})") from None
        if not prompts:
            raise GenerationError(f"--prompt-file {args.prompt_file}: no prompts (the file has no non-empty line)")
        return prompts
    return [sys.stdin.read().rstrip("\n")]  # the newline echo and editors end input with


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p)
        prompts = read_prompts(args)
        loaded, model, tokenizer = load_model_and_tokenizer(args)
        generator = torch.Generator().manual_seed(args.seed)
        for number, prompt in enumerate(prompts, start=1):
            result = generate(model, tokenizer.tokenize(prompt), args.max_new_tokens, sampling, tokenizer.eod,
                              tokenizer.vocab_size, use_cache=not args.no_kv_cache, generator=generator)
            text = [t for t in result.tokens if t != tokenizer.eod]
            print(prompt + tokenizer.detokenize(text), flush=True)
            print(f"--- end of sample {number} ---", flush=True)
            if result.prompt_tokens_dropped:
                print(f"note: prompt {number} kept its last tokens only ({result.prompt_tokens_dropped} dropped to fit "
                      f"{loaded.config.max_position_embeddings} positions)", file=sys.stderr)
            print(f" sample {number} | generated tokens: {len(result.tokens)} | time (s): {result.seconds:.3f} | "
                  f"tokens/s: {result.tokens_per_second:.1f} | kv cache: {'off' if args.no_kv_cache else 'on'} | "
                  f"stopped at eod: {result.stopped_at_eod} |", file=sys.stderr, flush=True)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
