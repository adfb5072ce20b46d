"""Tokenizers: GPT-2 ids equal an independent pure-Python GPT-2 BPE (OpenAI's merge-rank
algorithm) on every dolly sample record; round trips; eod/vocab/padding; Null and SentencePiece;
errors; tools/gpt2_vocab.py conversion; Llama-3's tiktoken file and Llama-2's SentencePiece model
(Llama3Tokenizer, Llama2Tokenizer), made offline in the tests."""
import base64
import json
import os
import subprocess
import sys

import pytest
import regex

from conftest import REPO_ROOT
from conftest import test_env as subprocess_env
from megatron.tokenizer.llama3_bpe import LLAMA3_PAT_STR
from megatron.tokenizer import (
    NullTokenizer,
    TokenizerConfig,
    TokenizerError,
    build_tokenizer,
    padded_vocab_size,
)
from tokenizer_files import train_sentencepiece, write_tiktoken_bpe

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


LLAMA3_SPLIT = regex.compile(LLAMA3_PAT_STR)


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory, dolly_texts):
    """(Llama-3 style tiktoken file, Llama-2 style SentencePiece model), made here from 60 dolly records."""
    folder = tmp_path_factory.mktemp("llama_tokenizers")
    text = "\n".join(dolly_texts[:60])
    return write_tiktoken_bpe(text, folder / "tokenizer.model"), train_sentencepiece(text, folder / "sp")


def reference_rank_bpe(ranks: dict[bytes, int], text: str) -> list[int]:
    """Byte-level BPE by lowest rank (tiktoken's rule) on Llama-3's split, in plain Python."""
    ids = []
    for piece in LLAMA3_SPLIT.findall(text):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            rank, i = min((ranks.get(a + b, float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[part] for part in parts]
    return ids


def test_llama3_tokenizer_reads_a_tiktoken_bpe_file(llama_files, dolly_texts):
    path = llama_files[0]
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in open(path))}
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="Llama3Tokenizer", tokenizer_model=path), verbose=False)
    n = len(ranks)  # 256 bytes + 300 merges; the 256 special tokens follow, as 128000.. follow Llama-3's ranks
    assert n == 556 and tok.vocab_size == n + 256 and tok.padded_vocab_size == 896
    assert (tok.bos, tok.eod) == (n, n + 1)  # <|begin_of_text|>, <|end_of_text|>
    assert tok.detokenize([n, n + 1, n + 9]) == "<|begin_of_text|><|end_of_text|><|eot_id|>"
    for text in dolly_texts:
        ids = tok.tokenize(text)
        assert ids[0] == tok.bos and ids[1:] == reference_rank_bpe(ranks, text)
        assert tok.detokenize(ids[1:]) == text
    assert tok.tokenize("") == [] and tok.tokenize("a<|end_of_text|>")[1:] == reference_rank_bpe(ranks, "a<|end_of_text|>")
    assert tok.tokenize_batch(dolly_texts[:20], num_threads=2) == [tok.tokenize(t) for t in dolly_texts[:20]]
    with pytest.raises(TokenizerError, match=r"Llama3Tokenizer: id 812 is outside the vocabulary \[0, 812\)"):
        tok.detokenize([5, 812])


def test_llama2_tokenizer_puts_bos_first_and_eod_is_eos(llama_files, dolly_texts):
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=llama_files[1]),
                          verbose=False)
    assert (tok.vocab_size, tok.padded_vocab_size, tok.bos, tok.eod) == (600, 640, 1, 2)  # Llama-2's bos 1, eos 2
    for text in dolly_texts[:100] + ["héllo  wörld 😀\n\ttabs"]:
        ids = tok.tokenize(text)
        assert ids[0] == 1 and 2 not in ids and tok.detokenize(ids) == text
    assert tok.tokenize("") == [] and tok.tokenize_batch(["", "a b"], 2) == [[], tok.tokenize("a b")]


def test_llama_tokenizer_file_errors_name_the_file_and_line(tmp_path, llama_files):
    tiktoken_file, sp_model = llama_files
    lines = open(tiktoken_file, encoding="ascii").read().splitlines()

    def llama3(path):
        return build_tokenizer(TokenizerConfig(tokenizer_type="Llama3Tokenizer", tokenizer_model=str(path)), verbose=False)

    def write(name, rows):
        (tmp_path / name).write_text("\n".join(rows) + "\n", encoding="ascii")
        return tmp_path / name

    with pytest.raises(TokenizerError, match=r"corrupt\.model:301: expected '<base64 token> <rank>', got 'IQ== x'"):
        llama3(write("corrupt.model", lines[:300] + ["IQ== x"] + lines[301:]))
    with pytest.raises(TokenizerError, match=r"twice\.model:557: rank 5 appears twice"):
        llama3(write("twice.model", lines + [f"{base64.b64encode(b'zzzz').decode()} 5"]))
    with pytest.raises(TokenizerError, match=r"gap\.model: ranks must be 0\.\.554, each once; rank 65 is missing"):
        llama3(write("gap.model", lines[:65] + lines[66:]))
    with pytest.raises(TokenizerError, match=r"nobyte\.model: no token for byte 0x41 \(1 of 256 bytes missing"):
        llama3(write("nobyte.model", lines[:65] + [f"{base64.b64encode(b'zzzz').decode()} 65"] + lines[66:]))
    with pytest.raises(TokenizerError, match=r"sp\.model:\d+: expected .*not a tiktoken BPE file"):
        llama3(sp_model)
    with pytest.raises(TokenizerError, match=r"--tokenizer-model meta-llama/Meta-Llama-3-8B: file not found "
                                             r"\(a local file: zero-lab downloads no tokenizer"):
        llama3("meta-llama/Meta-Llama-3-8B")
    with pytest.raises(TokenizerError, match=r"--tokenizer-model .*tokenizer\.model: not a SentencePiece model"):
        build_tokenizer(TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=tiktoken_file), verbose=False)
    with pytest.raises(TokenizerError, match="--tokenizer-type Llama3Tokenizer needs --tokenizer-model"):
        build_tokenizer(TokenizerConfig(tokenizer_type="Llama3Tokenizer"), verbose=False)
