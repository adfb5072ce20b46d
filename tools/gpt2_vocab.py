"""Write GPT-2's vocab.json and merges.txt without the Hugging Face hub.

The GPT-2 BPE ships in the openai-whisper source distribution on PyPI as
`whisper/assets/gpt2.tiktoken` (one "base64(token) rank" per line). This tool downloads that
sdist with pip (no install), or takes a local ranks file (--tiktoken-file), and converts it:

* vocab.json: GPT-2's byte-to-unicode spelling of each token -> rank, plus <|endoftext|>;
* merges.txt: "#version: 0.2" and, for every multi-byte token in rank order, the pair BPE
  produces from the token's bytes using only lower ranks (that pair is the merge creating it).

Before anything is written the converted files are loaded back with the project's
GPT2BPETokenizer and must give the same ranks and the same ids on sample text as a tiktoken
Encoding built straight from the ranks file. Files are written under temporary names and
renamed, so an interrupted run leaves no half-written vocabulary.

    python tools/gpt2_vocab.py --output-dir data [--tiktoken-file gpt2.tiktoken] [--verify-text FILE]
"""
from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tiktoken

from megatron.tokenizer.gpt2_bpe import EOD_TOKEN, GPT2_PAT_STR, MERGES_HEADER, GPT2BPETokenizer, bytes_to_unicode
from megatron.errors import ZeroLabError

WHISPER_REQUIREMENT = "openai-whisper==20250625"
RANKS_MEMBER = "whisper/assets/gpt2.tiktoken"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
VOCAB_NAME, MERGES_NAME = "gpt2-vocab.json", "gpt2-merges.txt"
# pip's messages when it cannot reach the index at all (as opposed to a missing package).
_UNREACHABLE_SIGNS = ("NewConnectionError", "ConnectTimeoutError", "Temporary failure in name resolution", "Could not fetch URL")
BUILTIN_SAMPLE = "Hello world! GPT-2's BPE: 12345 tokens,\n\n  spaces\tand ünïcødé 日本語 🙂 <|endoftext|> it'll"


class Gpt2VocabError(ZeroLabError):
    """The ranks file could not be obtained or did not convert faithfully."""


def cache_path() -> Path:
    root = os.environ.get("ZERO_LAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zero-lab"
    )
    return Path(root) / "gpt2.tiktoken"


def download_ranks(workdir: Path) -> bytes:
    """gpt2.tiktoken from the pinned openai-whisper sdist (pip download, nothing installed)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--timeout", "15", "--retries", "1", WHISPER_REQUIREMENT, "-d", str(workdir)]
    print(f"[gpt2_vocab] downloading {WHISPER_REQUIREMENT} sdist from PyPI (pip download, no install)", flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        if any(sign in result.stderr for sign in _UNREACHABLE_SIGNS):
            last = "the package index is unreachable from this machine"
        raise Gpt2VocabError(
            f"could not download {WHISPER_REQUIREMENT} from PyPI (pip exit {result.returncode}: {last}); "
            "provide the GPT-2 files with VOCAB_FILE/MERGE_FILE or a ranks file with --tiktoken-file"
        )
    archives = list(workdir.glob("*.tar.gz"))
    if len(archives) != 1:
        raise Gpt2VocabError(f"pip download left {len(archives)} archives in {workdir}, expected one sdist")
    with tarfile.open(archives[0]) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith("/" + RANKS_MEMBER)]
        if not members:
            raise Gpt2VocabError(f"{archives[0].name}: has no {RANKS_MEMBER}")
        return tar.extractfile(members[0]).read()


def obtain_ranks(tiktoken_file: str | None) -> bytes:
    if tiktoken_file:
        try:
            return Path(tiktoken_file).read_bytes()
        except OSError as err:
            raise Gpt2VocabError(f"--tiktoken-file {tiktoken_file}: {err.strerror}") from None
    cached = cache_path()
    if cached.is_file() and hashlib.sha256(cached.read_bytes()).hexdigest() == RANKS_SHA256:
        print(f"[gpt2_vocab] using cached {cached}", flush=True)
        return cached.read_bytes()
    with tempfile.TemporaryDirectory() as workdir:
        data = download_ranks(Path(workdir))
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANKS_SHA256:
        raise Gpt2VocabError(f"{RANKS_MEMBER} in {WHISPER_REQUIREMENT} has sha256 {digest}, expected {RANKS_SHA256}")
    _store_in_cache(cached, data)
    return data


def _store_in_cache(path: Path, data: bytes) -> None:
    """Keep the download for offline reuse; a read-only cache is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as err:
        print(f"[gpt2_vocab] note: could not cache {path} ({err.strerror})", flush=True)


def parse_ranks(data: bytes, source: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise Gpt2VocabError(f"{source}:{line_no}: expected 'base64-token rank', got {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise Gpt2VocabError(f"{source}: ranks are not the distinct integers 0..{len(ranks) - 1}")
    return ranks


def merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair that creates `token`: BPE on its bytes using only ranks below its own."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        candidates = [(ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1)]
        rank, i = min(candidates)
        if rank >= limit:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise Gpt2VocabError(f"token {token!r} (rank {limit}) cannot be built from lower-ranked tokens")
    return parts[0], parts[1]


def convert(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[str]]:
    """(vocab.json mapping, merge lines) in GPT-2's byte-to-unicode spelling."""
    spell = bytes_to_unicode()

    def spelled(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    vocab = {spelled(token): rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])}
    vocab[EOD_TOKEN] = len(ranks)
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            first, second = merge_of(token, ranks)
            merges.append(f"{spelled(first)} {spelled(second)}")
    return vocab, merges


def verify(vocab_path: Path, merges_path: Path, ranks: dict[bytes, int], sample: str) -> int:
    """Load the written files back and compare with tiktoken on the raw ranks; returns tokens checked."""
    tokenizer = GPT2BPETokenizer(str(vocab_path), str(merges_path))
    reference = tiktoken.Encoding(
        name="gpt2-ranks", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks, special_tokens={EOD_TOKEN: len(ranks)}
    )
    if tokenizer.vocab_size != reference.n_vocab or tokenizer.eod != len(ranks):
        raise Gpt2VocabError(f"converted vocabulary has {tokenizer.vocab_size} ids, expected {reference.n_vocab}")
    ours, theirs = tokenizer.tokenize(sample), reference.encode_ordinary(sample)
    if ours != theirs:
        first = next(i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b)
        raise Gpt2VocabError(f"converted files tokenize the sample differently from the ranks file at token {first}")
    return len(ours)


def write_vocab(output_dir: Path, ranks: dict[bytes, int], sample: str) -> None:
    vocab, merges = convert(ranks)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = {output_dir / VOCAB_NAME: json.dumps(vocab, ensure_ascii=False),
             output_dir / MERGES_NAME: "\n".join([MERGES_HEADER, *merges]) + "\n"}
    temps = {path: path.with_name(f"{path.name}.tmp-{os.getpid()}") for path in final}
    try:
        for path, text in final.items():
            temps[path].write_text(text, encoding="utf-8")
        checked = verify(temps[output_dir / VOCAB_NAME], temps[output_dir / MERGES_NAME], ranks, sample)
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    print(f"[gpt2_vocab] wrote {output_dir / VOCAB_NAME} ({len(vocab)} ids) and {output_dir / MERGES_NAME} "
          f"({len(merges)} merges); verified on {checked} sample tokens", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help=f"folder for {VOCAB_NAME} and {MERGES_NAME}")
    parser.add_argument("--tiktoken-file", help="local gpt2.tiktoken ranks file (skips the PyPI download)")
    parser.add_argument("--verify-text", help="text file whose tokenization must match the ranks file (e.g. the dolly jsonl)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        sample = BUILTIN_SAMPLE
        if args.verify_text:
            try:
                sample += Path(args.verify_text).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise Gpt2VocabError(f"--verify-text {args.verify_text}: {err}") from None
        source = args.tiktoken_file or RANKS_MEMBER
        ranks = parse_ranks(obtain_ranks(args.tiktoken_file), source)
        write_vocab(Path(args.output_dir), ranks, sample)
    except ZeroLabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
