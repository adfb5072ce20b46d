"""Evaluate a checkpoint on the validation split of the dolly dataset it was trained on.

    python tools/eval_dolly.py --load runs/gpt_tiny_Z1/checkpoints --num-records 5

Prints, for the first --num-records validation records, the instruction (and context), the
model's greedy response and the expected response, then the validation loss and perplexity
(Megatron's validation line) and the time taken. --data-path and --split default to the
ones the run trained with. --dolly-jsonl defaults to the records the dataset was made from: the jsonl its
sidecar (PREFIX.meta.json, megatron/data/dataset_sidecar.py) names as its source when that holds dolly
records; when it is the text jsonl tools/process_databricks_gpt2.sh tokenizes, the dolly file that script
takes (databricks-dolly-15k.jsonl next to the data, else the committed sample) whose texts it holds;
without a sidecar, databricks-dolly-15k.jsonl next to the data.
A record's document must be its training text (context, instruction, response joined by newlines),
so records and documents are checked to match.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from megatron.data.dataset_sidecar import read_sidecar, sidecar_path
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import ZeroLabError
from megatron.inference.evaluation import (
    single_prefix,
    validation_documents,
    validation_loss,
)
from megatron.inference.generation import SamplingConfig, generate
from megatron.inference.loading import add_model_flags, load_model_and_tokenizer
from megatron.training_log import validation_line


# the dolly file tools/process_databricks_gpt2.sh falls back to when DATA_DIR has no databricks-dolly-15k.jsonl
COMMITTED_SAMPLE = Path(__file__).resolve().parent.parent / "data" / "samples" / "dolly-sample.jsonl"


class DollyEvalError(ZeroLabError, ValueError):
    """Records and dataset that do not belong together, or missing inputs; names the flag."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_model_flags(parser)
    parser.add_argument("--data-path", nargs="*", default=None, help="dataset prefix (default: the run's)")
    parser.add_argument("--split", default=None, help="Megatron --split (default: the run's)")
    parser.add_argument("--dolly-jsonl", default=None, help="the dolly records the dataset was made from")
    parser.add_argument("--num-records", type=int, default=5, help="validation records to print (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=None, help="loss window (default: the model's)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=None, help="cap on loss samples (default: one pass)")
    parser.add_argument("--seed", type=int, default=1234, help="--seed of the run (orders the samples)")
    return parser.parse_args(argv)


def record_parts(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DollyEvalError(f"{where}: malformed JSON ({err.msg})") from None
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("instruction", "response")):
        raise DollyEvalError(f"{where}: expected a dolly record with string instruction and response")
    context = record.get("context") or ""
    # the training text (docs/data-format.md): context, instruction, response joined by newlines, empty context left out
    prompt = "\n".join(([context] if context.strip() else []) + [record["instruction"]]) + "\n"
    return dict(record, context=context, prompt=prompt)


def read_records(path: str, num_documents: int) -> list[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line for line in handle if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise DollyEvalError(f"--dolly-jsonl {path}: cannot read ({err})") from None
    if len(lines) != num_documents:
        raise DollyEvalError(f"--dolly-jsonl {path} has {len(lines)} records but the dataset has {num_documents} "
                             "documents; give the jsonl the dataset was made from")
    return lines


def show_records(args, model, tokenizer, indexed: MMapIndexedDataset, documents: range,
                 jsonl: str) -> tuple[int, float]:
    """Print the first records; returns (tokens generated, seconds)."""
    lines = read_records(jsonl, len(indexed))
    generated, seconds = 0, 0.0
    for doc in documents[:args.num_records]:
        record = record_parts(lines[doc], f"{jsonl}:record {doc + 1}")
        stored = tokenizer.detokenize([t for t in indexed[doc].tolist() if t != tokenizer.eod])
        if stored != record["prompt"] + record["response"]:
            raise DollyEvalError(f"--dolly-jsonl {jsonl}: record {doc + 1} is not document {doc} of the dataset; "
                                 "give the jsonl the dataset was made from")
        result = generate(model, tokenizer.tokenize(record["prompt"]), args.max_new_tokens,
                          SamplingConfig(greedy=True), tokenizer.eod, tokenizer.vocab_size)
        generated, seconds = generated + len(result.tokens), seconds + result.seconds
        print(f"===== validation record {doc - documents.start + 1} of {len(documents)} "
              f"(document {doc}, category {record.get('category', '?')}) =====")
        if record["context"].strip():
            print(f"context: {record['context']}")
        print(f"instruction: {record['instruction']}")
        print(f"model response: {tokenizer.detokenize([t for t in result.tokens if t != tokenizer.eod]).strip()}")
        print(f"expected response: {record['response']}", flush=True)
    return generated, seconds


def training_texts(path: str) -> tuple[str, list[str]] | None:
    """("dolly", the records' training texts) or ("text", a {"text": ...} jsonl's texts); None when the file
    is neither (or unreadable)."""
    try:
        with open(path, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if records and all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in records):
        return "text", [r["text"] for r in records]
    try:
        parts = [record_parts(json.dumps(r), path) for r in records]
    except DollyEvalError:
        return None
    return ("dolly", [p["prompt"] + p["response"] for p in parts]) if parts else None


def default_jsonl(prefix: str) -> str:
    """The dolly records the dataset was made from, when --dolly-jsonl is not given (the module's docstring);
    says in one line which file it took from the sidecar, or fails in one line naming what it looked for."""
    sidecar = sidecar_path(prefix)
    source = ((read_sidecar(prefix) or {}).get("source") or {}).get("path")
    conventional = os.path.join(os.path.dirname(prefix), "databricks-dolly-15k.jsonl")
    kind, texts = (training_texts(source) if source else None) or (None, None)
    if kind == "dolly":
        print(f"--dolly-jsonl not given: using {source}, the source {sidecar} names", flush=True)
        return source
    candidates = [conventional, str(COMMITTED_SAMPLE)]
    if kind == "text":
        for candidate in candidates:
            if os.path.isfile(candidate) and training_texts(candidate) == ("dolly", texts):
                print(f"--dolly-jsonl not given: using {candidate}, whose records are the texts of {source}, the "
                      f"source {sidecar} names", flush=True)
                return candidate
        raise DollyEvalError(f"--dolly-jsonl is needed: {sidecar} names {source}, a text jsonl, and neither "
                             f"{' nor '.join(candidates)} holds the dolly records it was made from; give the dolly "
                             "records the dataset was made from")
    if os.path.isfile(conventional):  # no usable sidecar: the name tools/process_databricks_gpt2.sh gives
        return conventional
    if source is None:
        found = f"no {sidecar} names a source (missing, or not describing this dataset)"
    else:
        what = "holds no dolly records" if os.path.exists(source) else "is missing"
        found = f"{sidecar} names {source}, which {what}"
    raise DollyEvalError(f"--dolly-jsonl is needed: {found}, and there is no {conventional}; give the dolly records "
                         "the dataset was made from")


def run(args: argparse.Namespace) -> None:
    loaded, model, tokenizer = load_model_and_tokenizer(args)
    data_path, split = args.data_path or loaded.data_path, args.split or loaded.split
    if not data_path or split is None:
        raise DollyEvalError("give --data-path and --split (the checkpoint does not record the run's data)")
    prefix = single_prefix(data_path)
    indexed = MMapIndexedDataset(prefix)
    documents = validation_documents(indexed, split, prefix)
    start = time.perf_counter()
    generated, gen_seconds = 0, 0.0
    if args.num_records > 0:
        generated, gen_seconds = show_records(args, model, tokenizer, indexed, documents,
                                              args.dolly_jsonl or default_jsonl(prefix))
    seq_length = args.seq_length or loaded.config.seq_length
    if seq_length > loaded.config.max_position_embeddings:
        raise DollyEvalError(f"--seq-length {seq_length} exceeds the model's {loaded.config.max_position_embeddings} "
                             "positions")
    result = validation_loss(model, prefix, split, seq_length, args.seed, args.micro_batch_size, args.eval_samples)
    print(validation_line(loaded.iteration, result.loss))
    print(f" dolly validation | documents: {len(documents)} | samples: {result.num_samples} | "
          f"tokens: {result.num_tokens} | loss time (s): {result.seconds:.3f} | generated tokens: {generated} | "
          f"generation tokens/s: {generated / gen_seconds if gen_seconds else 0.0:.1f} | "
          f"total time (s): {time.perf_counter() - start:.3f} |", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        if args.num_records < 0 or args.micro_batch_size < 1:
            raise DollyEvalError("--num-records must be >= 0 and --micro-batch-size >= 1")
        with torch.no_grad():
            run(args)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
