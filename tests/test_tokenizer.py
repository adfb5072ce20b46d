"""Tokenizers: GPT-2 ids equal an independent pure-Python GPT-2 BPE (OpenAI's merge-rank
algorithm) on every dolly sample record; round trips; eod/vocab/padding; Null and SentencePiece;
errors; tools/gpt2_vocab.py conversion."""
import base64
import json
import os
import subprocess
import sys

import pytest
import regex

from conftest import REPO_ROOT
from conftest import test_env as subprocess_env
from megatron.tokenizer import (
    NullTokenizer,
    TokenizerConfig,
    TokenizerError,
    build_tokenizer,
    padded_vocab_size,
)

GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


class ReferenceGPT2:
    """GPT-2's original encoder: byte-to-unicode, regex split, BPE by lowest merge rank."""

    def __init__(self, vocab_file, merge_file):
        self.encoder = json.load(open(vocab_file, encoding="utf-8"))
        lines = open(merge_file, encoding="utf-8").read().split("\n")[1:]
        self.merge_rank = {tuple(line.split()): i for i, line in enumerate(lines) if line}
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        extra = [b for b in range(256) if b not in printable]
        self.byte_char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
        self.cache = {}

    def bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.merge_rank.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        self.cache[word] = parts
        return parts

    def encode(self, text):
        ids = []
        for piece in GPT2_SPLIT.findall(text):
            word = "".join(self.byte_char[b] for b in piece.encode("utf-8"))
            ids += [self.encoder[token] for token in self.bpe(word)]
        return ids


@pytest.fixture(scope="module")
def gpt2_files(dolly_data_dir):
    return str(dolly_data_dir / "gpt2-vocab.json"), str(dolly_data_dir / "gpt2-merges.txt")


@pytest.fixture(scope="module")
def gpt2(gpt2_files):
    vocab, merges = gpt2_files
    return build_tokenizer(TokenizerConfig(vocab_file=vocab, merge_file=merges), verbose=False)


@pytest.fixture(scope="module")
def dolly_texts(dolly_sample):
    records = [json.loads(line) for line in open(dolly_sample, encoding="utf-8")]
    return [f"{r['context']}\n{r['instruction']}\n{r['response']}" for r in records]


def test_gpt2_ids_equal_reference_bpe_on_every_dolly_record(gpt2, gpt2_files, dolly_texts):
    reference = ReferenceGPT2(*gpt2_files)
    assert len(dolly_texts) == 382
    for text in dolly_texts:
        assert gpt2.tokenize(text) == reference.encode(text)
    assert gpt2.tokenize_batch(dolly_texts, num_threads=2) == [gpt2.tokenize(t) for t in dolly_texts]


def test_gpt2_known_ids_round_trip_eod_and_vocab(gpt2, dolly_texts):
    assert gpt2.tokenize("Hello world") == [15496, 995]  # GPT-2's published ids
    assert gpt2.eod == 50256 and gpt2.vocab_size == 50257
    # GPT-2 encodes special-token text as ordinary text.
    assert 50256 not in gpt2.tokenize("a<|endoftext|>b")
    assert gpt2.detokenize([15496, 995, 50256]) == "Hello world<|endoftext|>"
    for text in dolly_texts:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    with pytest.raises(TokenizerError, match=r"id 50300 is outside the vocabulary \[0, 50257\)"):
        gpt2.detokenize([15496, 50300])


def test_padded_vocab_size_and_megatron_message(gpt2_files, capsys):
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(50304, 128, 1) == 50304
    vocab, merges = gpt2_files
    tok = build_tokenizer(TokenizerConfig(vocab_file=vocab, merge_file=merges, tensor_model_parallel_size=2))
    assert tok.padded_vocab_size == 50432
    out = capsys.readouterr().out
    assert "> building GPT2BPETokenizer tokenizer ..." in out
    assert " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)" in out
    with pytest.raises(TokenizerError, match="--make-vocab-size-divisible-by 0"):
        padded_vocab_size(50257, 0, 1)


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=1000), verbose=False)
    assert isinstance(tok, NullTokenizer)
    assert tok.tokenize(" 1 2\n999 ") == [1, 2, 999]
    assert tok.eod == 1000 and tok.vocab_size == 1001 and tok.padded_vocab_size == 1024
    assert tok.detokenize([3, 4]) == "3 4"
    with pytest.raises(TokenizerError, match="whitespace-separated integer ids"):
        tok.tokenize("1 two")
    with pytest.raises(TokenizerError, match=r"id 1000 is outside \[0, --vocab-size 1000\)"):
        tok.tokenize("1000")


def test_sentencepiece_tokenizer_trained_on_dolly(tmp_path, dolly_texts):
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(t.replace("\n", " ") for t in dolly_texts), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type="bpe",
        character_coverage=1.0, minloglevel=2,
    )
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer",
                                          tokenizer_model=str(tmp_path / "sp.model")), verbose=False)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tok.vocab_size == 300 and tok.padded_vocab_size == 384
    assert tok.eod == processor.eos_id() == 2
    text = dolly_texts[0].replace("\n", " ")
    ids = tok.tokenize(text)
    assert ids == processor.encode(text) and all(0 <= i < 300 for i in ids)
    assert tok.detokenize(ids) == text
    assert tok.tokenize_batch(dolly_texts[:20], num_threads=2) == [tok.tokenize(t) for t in dolly_texts[:20]]


def test_tokenizer_errors_name_the_flag(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    with pytest.raises(TokenizerError, match="--tokenizer-type GPT2BPETokenizer needs --merge-file"):
        build_tokenizer(TokenizerConfig(vocab_file=vocab), verbose=False)
    with pytest.raises(TokenizerError, match=r"--vocab-file .*missing\.json: file not found"):
        build_tokenizer(TokenizerConfig(vocab_file=str(tmp_path / "missing.json"), merge_file=merges), verbose=False)
    with pytest.raises(TokenizerError, match="--tokenizer-type BertWordPiece: unknown"):
        build_tokenizer(TokenizerConfig(tokenizer_type="BertWordPiece"), verbose=False)
    with pytest.raises(TokenizerError, match="--tokenizer-model .*: file not found"):
        build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model="nope.model"))
    with pytest.raises(TokenizerError, match="--vocab-size 0: NullTokenizer needs a positive"):
        build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=0), verbose=False)


def test_vocab_file_that_is_not_byte_level_is_rejected(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    encoder = json.load(open(vocab, encoding="utf-8"))
    encoder["hello world"] = encoder.pop("Ġhello")  # a raw space is not a GPT-2 vocab character
    (tmp_path / "vocab.json").write_text(json.dumps(encoder), encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"vocab\.json: token 'hello world' is not in GPT-2's byte-level alphabet"):
        build_tokenizer(TokenizerConfig(vocab_file=str(tmp_path / "vocab.json"), merge_file=merges), verbose=False)
    with pytest.raises(TokenizerError, match="--vocab-file .*: cannot read"):
        build_tokenizer(TokenizerConfig(vocab_file=str(tmp_path), merge_file=merges), verbose=False)


def test_merges_out_of_order_with_the_vocab_are_rejected(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    lines = open(merges, encoding="utf-8").read().split("\n")
    lines[1], lines[2] = lines[2], lines[1]  # swap the first two merges
    (tmp_path / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"merges\.txt:3: merge 'Ġ t' -> id 256 is out of merge order"):
        build_tokenizer(TokenizerConfig(vocab_file=vocab, merge_file=str(tmp_path / "merges.txt")), verbose=False)


def run_gpt2_vocab(*args, **env):
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpt2_vocab.py"), *map(str, args)],
                          env=subprocess_env(**env), capture_output=True, text=True, timeout=120)


def test_gpt2_vocab_tool_converts_a_ranks_file_back_to_identical_files(tmp_path, gpt2_files):
    """Ranks written from the vocab must convert back to byte-identical vocab.json and merges.txt."""
    vocab, merges = gpt2_files
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    char_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
    encoder = json.load(open(vocab, encoding="utf-8"))
    with open(tmp_path / "gpt2.tiktoken", "wb") as ranks:
        for token, rank in sorted(encoder.items(), key=lambda item: item[1]):
            if token != "<|endoftext|>":
                ranks.write(base64.b64encode(bytes(char_byte[c] for c in token)) + b" %d\n" % rank)
    result = run_gpt2_vocab("--output-dir", tmp_path / "out", "--tiktoken-file", tmp_path / "gpt2.tiktoken")
    assert result.returncode == 0, result.stderr
    assert "(50257 ids)" in result.stdout and "(50000 merges)" in result.stdout
    assert (tmp_path / "out" / "gpt2-merges.txt").read_bytes() == open(merges, "rb").read()
    assert json.load(open(tmp_path / "out" / "gpt2-vocab.json", encoding="utf-8")) == encoder


def test_gpt2_vocab_tool_rejects_a_bad_ranks_file(tmp_path):
    (tmp_path / "bad.tiktoken").write_bytes(b"IQ== 0\nnot-base64!! 1\n")
    result = run_gpt2_vocab("--output-dir", tmp_path / "out", "--tiktoken-file", tmp_path / "bad.tiktoken")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "bad.tiktoken:2: expected 'base64-token rank'" in result.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_gpt2_vocab_tool_without_pypi_says_so(tmp_path):
    # An empty cache and an index nobody listens on: the download must fail with a clear message.
    result = run_gpt2_vocab("--output-dir", tmp_path / "out", ZERO_LAB_CACHE=tmp_path / "cache",
                            PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="http://127.0.0.1:9/simple",
                            PIP_FIND_LINKS=tmp_path, PIP_CONFIG_FILE=os.devnull)
    assert result.returncode == 1
    assert result.stderr.startswith("error: could not download openai-whisper==20250625 from PyPI")
    assert "unreachable" in result.stderr and "VOCAB_FILE/MERGE_FILE" in result.stderr and "--tiktoken-file" in result.stderr
    assert not (tmp_path / "out").exists()
