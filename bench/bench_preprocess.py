"""Benchmark tools/preprocess_data.py against straightforward per-document encoding.

Builds a dolly-shaped corpus (the real dolly sample records, repeated with a small
perturbation to --docs documents, text = context/instruction/response as in
process_databricks_gpt2.sh) and runs:

  reference  one process: json.loads + GPT2BPETokenizer.tokenize + builder.add_item per document
  upstream   (with --upstream) Megatron-DeepSpeed's scheme: multiprocessing.Pool(--workers),
             json.loads + a pure-Python GPT-2 BPE (the algorithm of Megatron's gpt2_tokenization.py)
  ours       `python tools/preprocess_data.py --workers N` as a subprocess (start-up included),
             and with --workers 1 when N > 1

It prints docs/s, MB/s, tokens/s and wall seconds for each and the speed-up of ours, and
fails unless every run wrote byte-identical .bin/.idx files.

    python bench/bench_preprocess.py [--docs 15000] [--workers 2] [--upstream] [--repeat 3] [--data-dir data]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import regex

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.tokenizer import GPT2BPETokenizer
from megatron.tokenizer.gpt2_bpe import GPT2_PAT_STR, bytes_to_unicode

REPO = Path(__file__).resolve().parent.parent

DOLLY_SAMPLE = REPO / "data" / "samples" / "dolly-sample.jsonl"


@dataclass
class Result:
    name: str
    seconds: float
    documents: int
    tokens: int
    num_bytes: int
    cpu_seconds: float  # user+sys of this process and its children: insensitive to other load


def cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def build_corpus(sample: Path, docs: int, path: Path) -> None:
    records = [json.loads(line) for line in sample.open(encoding="utf-8")]
    with path.open("w", encoding="utf-8") as out:
        for i in range(docs):
            r = records[i % len(records)]
            parts = [r["context"], r["instruction"], r["response"]]
            text = "\n".join(parts if r["context"] else parts[1:])
            if i >= len(records):  # perturb repeats so documents differ
                text = f"{text} (variant {i // len(records)})"
            out.write(json.dumps({"text": text}) + "\n")


def run_reference(corpus: Path, prefix: Path, vocab: str, merges: str) -> Result:
    start, cpu = time.perf_counter(), cpu_now()
    tokenizer = GPT2BPETokenizer(vocab, merges)
    builder = MMapIndexedDatasetBuilder(f"{prefix}_text_document.bin", best_fitting_dtype(tokenizer.vocab_size))
    documents = tokens = 0
    for line in corpus.open("rb"):
        ids = tokenizer.tokenize(json.loads(line)["text"]) + [tokenizer.eod]
        builder.add_item(ids)
        builder.end_document()
        documents, tokens = documents + 1, tokens + len(ids)
    builder.finalize(f"{prefix}_text_document.idx")
    return Result("reference", time.perf_counter() - start, documents, tokens, corpus.stat().st_size, cpu_now() - cpu)


class PythonGPT2BPE:
    """GPT-2's original encoder (byte-to-unicode, regex split, lowest-merge-rank BPE, word cache)."""

    def __init__(self, vocab: str, merges: str):
        self.encoder = json.load(open(vocab, encoding="utf-8"))
        lines = open(merges, encoding="utf-8").read().split("\n")[1:]
        self.ranks = {tuple(line.split()): i for i, line in enumerate(lines) if line}
        self.byte_char = bytes_to_unicode()
        self.pattern = regex.compile(GPT2_PAT_STR)
        self.cache: dict[str, list[str]] = {}

    def bpe(self, word: str) -> list[str]:
        if word not in self.cache:
            parts = list(word)
            while len(parts) > 1:
                rank, i = min((self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(parts, parts[1:])))
                if rank == float("inf"):
                    break
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            self.cache[word] = parts
        return self.cache[word]

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pattern.findall(text):
            ids += [self.encoder[t] for t in self.bpe("".join(self.byte_char[b] for b in piece.encode("utf-8")))]
        return ids


_worker_bpe: PythonGPT2BPE | None = None


def _init_worker(vocab: str, merges: str) -> None:
    global _worker_bpe  # per-process tokenizer, as in Megatron's Encoder.initializer
    _worker_bpe = PythonGPT2BPE(vocab, merges)


def _encode_line(line: bytes) -> list[int]:
    return _worker_bpe.encode(json.loads(line)["text"]) + [50256]


def run_upstream_style(corpus: Path, prefix: Path, vocab: str, merges: str, workers: int) -> Result:
    start, cpu = time.perf_counter(), cpu_now()
    builder = MMapIndexedDatasetBuilder(f"{prefix}_text_document.bin", best_fitting_dtype(50257))
    documents = tokens = 0
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(vocab, merges)) as pool:
        for ids in pool.imap(_encode_line, corpus.open("rb"), chunksize=32):
            builder.add_item(ids)
            builder.end_document()
            documents, tokens = documents + 1, tokens + len(ids)
    builder.finalize(f"{prefix}_text_document.idx")
    return Result("upstream", time.perf_counter() - start, documents, tokens, corpus.stat().st_size, cpu_now() - cpu)


def run_ours(corpus: Path, prefix: Path, vocab: str, merges: str, workers: int) -> Result:
    command = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus), "--output-prefix",
               str(prefix), "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", str(workers)]
    start, cpu = time.perf_counter(), cpu_now()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - start, cpu_now() - cpu
    if result.returncode != 0:
        sys.exit(f"error: preprocess_data.py failed: {result.stderr.strip()}")
    # "Processed N documents, T tokens in ..."
    words = result.stdout.strip().splitlines()[-1].split()
    return Result(f"ours (--workers {workers})", seconds, int(words[1]), int(words[3]), corpus.stat().st_size, cpu)


def vocab_files(data_dir: Path) -> tuple[str, str]:
    vocab, merges = data_dir / "gpt2-vocab.json", data_dir / "gpt2-merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        subprocess.run([sys.executable, str(REPO / "tools" / "gpt2_vocab.py"), "--output-dir", str(data_dir)],
                       check=True)
    return str(vocab), str(merges)


def print_table(results: list[Result], ours: Result) -> None:
    print(f"{'run':<22}{'docs/s':>10}{'MB/s':>9}{'tokens/s':>12}{'wall s':>9}{'cpu s':>8}{'ours faster':>13}")
    for r in results:
        print(f"{r.name:<22}{r.documents / r.seconds:>10.0f}{r.num_bytes / r.seconds / 1e6:>9.2f}"
              f"{r.tokens / r.seconds:>12.0f}{r.seconds:>9.3f}{r.cpu_seconds:>8.2f}{r.seconds / ours.seconds:>12.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=15000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--upstream", action="store_true", help="also time the Pool + pure-Python BPE scheme")
    parser.add_argument("--data-dir", type=Path, default=REPO / "data", help="holds (or gets) gpt2-vocab.json/merges")
    parser.add_argument("--sample", type=Path, default=DOLLY_SAMPLE)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the table shows the fastest")
    args = parser.parse_args()
    vocab, merges = vocab_files(args.data_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "dolly_shaped.jsonl"
        build_corpus(args.sample, args.docs, corpus)
        print(f"corpus: {args.docs} dolly-shaped documents, {corpus.stat().st_size / 1e6:.2f} MB; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; fastest of {args.repeat} runs each")
        runs = [lambda: run_reference(corpus, tmp / "reference", vocab, merges)]
        if args.upstream:
            runs.append(lambda: run_upstream_style(corpus, tmp / "upstream", vocab, merges, args.workers))
        if args.workers > 1:  # the same tool on one worker shows what the extra workers add
            runs.append(lambda: run_ours(corpus, tmp / "ours1", vocab, merges, 1))
        runs.append(lambda: run_ours(corpus, tmp / "ours", vocab, merges, args.workers))
        # Fastest of --repeat runs: on a shared machine other jobs only ever add time.
        results = [min((run() for _ in range(args.repeat)), key=lambda r: r.seconds) for run in runs]
        ours = results[-1]
        print_table(results, ours)
        names = [Path(f"{prefix}_text_document.{s}") for prefix in ("reference", "upstream", "ours1", "ours")
                 for s in ("bin", "idx")]
        outputs = {}
        for path in names:
            if (tmp / path).exists():
                outputs.setdefault(path.suffix, set()).add((tmp / path).read_bytes())
        if any(len(contents) != 1 for contents in outputs.values()):
            print("error: outputs differ between runs", file=sys.stderr)
            return 1
        print("outputs byte-identical: " + ", ".join(str(p) for p in names if (tmp / p).exists()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
