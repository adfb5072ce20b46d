"""`build_tokenizer` (Megatron's --tokenizer-type names), padded vocab size, and the
SentencePiece (Llama2Tokenizer too) and Null tokenizers. Every tokenizer has `.tokenize(text) -> list[int]`,
`.tokenize_batch(texts, num_threads)`, `.detokenize(ids) -> str`, `.eod` and `.vocab_size`.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.tokenizer.errors import TokenizerError
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.llama3_bpe import Llama3Tokenizer, require_local_file


@dataclass
class TokenizerConfig:
    """The tokenizer flags of Megatron (`--tokenizer-type`, `--vocab-file`, ...).

    `build_tokenizer` reads these attributes from any object, so the training arguments
    dataclass can be passed directly.
    """

    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    tensor_model_parallel_size: int = 1


class SentencePieceTokenizer:
    """A SentencePiece model (--tokenizer-model); eod is the model's end-of-sentence id."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        import sentencepiece  # imported here: only this tokenizer needs it

        require_local_file(model_file)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"--tokenizer-model {model_file}: not a SentencePiece model ({err})") from None
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            raise TokenizerError(f"--tokenizer-model {model_file}: model has no end-of-sentence piece (eos_id=-1)")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=max(1, num_threads))

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: a SentencePiece model, BOS first, eod = the model's EOS."""

    name = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.bos = self._sp.bos_id()
        if self.bos < 0:
            raise TokenizerError(f"--tokenizer-model {model_file}: model has no beginning-of-sentence piece (bos_id=-1)")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int, add_bos=True) if text else []

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        encoded = self._sp.encode(texts, out_type=int, add_bos=True, num_threads=max(1, num_threads))
        return [ids if text else [] for ids, text in zip(encoded, texts)]


class NullTokenizer:
    """Megatron's NullTokenizer: text is whitespace-separated ids below --vocab-size; eod = vocab_size."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size is None or vocab_size <= 0:
            raise TokenizerError(f"--vocab-size {vocab_size}: NullTokenizer needs a positive vocabulary size")
        self._size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._size_without_eod

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(token) for token in text.split()]
        except ValueError as err:
            raise TokenizerError(f"NullTokenizer: text must be whitespace-separated integer ids ({err})") from None
        for token in ids:
            if not 0 <= token < self._size_without_eod:
                raise TokenizerError(f"NullTokenizer: id {token} is outside [0, --vocab-size {self._size_without_eod})")
        return ids

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "Llama3Tokenizer", "NullTokenizer")


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp_size: int = 1) -> int:
    """Round the vocabulary up so the embedding splits evenly over TP ranks in aligned chunks."""
    if divisible_by < 1:
        raise TokenizerError(f"--make-vocab-size-divisible-by {divisible_by}: must be >= 1")
    if tp_size < 1:
        raise TokenizerError(f"--tensor-model-parallel-size {tp_size}: must be >= 1")
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _require(cfg, flag: str, attr: str, tokenizer_type: str):
    value = getattr(cfg, attr, None)
    if value is None:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    return value


def _make_tokenizer(cfg):
    tokenizer_type = getattr(cfg, "tokenizer_type", None)
    if tokenizer_type == "GPT2BPETokenizer":
        vocab_file = _require(cfg, "--vocab-file", "vocab_file", tokenizer_type)
        merge_file = _require(cfg, "--merge-file", "merge_file", tokenizer_type)
        return GPT2BPETokenizer(str(vocab_file), str(merge_file))
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(str(_require(cfg, "--tokenizer-model", "tokenizer_model", tokenizer_type)))
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(str(_require(cfg, "--tokenizer-model", "tokenizer_model", tokenizer_type)))
    if tokenizer_type == "Llama3Tokenizer":
        return Llama3Tokenizer(str(_require(cfg, "--tokenizer-model", "tokenizer_model", tokenizer_type)))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(_require(cfg, "--vocab-size", "vocab_size", tokenizer_type))
    raise TokenizerError(f"--tokenizer-type {tokenizer_type}: unknown (expected one of {', '.join(TOKENIZER_TYPES)})")


def build_tokenizer(cfg, verbose: bool = True):
    """The tokenizer `cfg.tokenizer_type` names, with `.padded_vocab_size` set.

    `verbose` prints Megatron's messages; pass False on all but one rank.
    """
    if verbose:
        print(f"> building {cfg.tokenizer_type} tokenizer ...", flush=True)
    tokenizer = _make_tokenizer(cfg)
    padded = padded_vocab_size(
        tokenizer.vocab_size,
        getattr(cfg, "make_vocab_size_divisible_by", 128),
        getattr(cfg, "tensor_model_parallel_size", 1),
    )
    tokenizer.padded_vocab_size = padded
    if verbose:
        print(
            f" > padded vocab (size: {tokenizer.vocab_size}) with {padded - tokenizer.vocab_size} "
            f"dummy tokens (new size: {padded})",
            flush=True,
        )
    return tokenizer
