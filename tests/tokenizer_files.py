"""Small Llama-style tokenizer files made offline from a text: a SentencePiece model (Llama-2's
format) trained by sentencepiece's own trainer, and a tiktoken BPE file (Llama-3's format) whose
ranks come from byte-level merges learned here on the same text."""
import base64
from collections import Counter

import regex

from megatron.tokenizer.llama3_bpe import LLAMA3_PAT_STR


def train_sentencepiece(text: str, prefix, vocab_size: int = 600) -> str:
    """PREFIX.model: a BPE SentencePiece model with Llama-2's ids (unk 0, bos 1, eos 2)."""
    import sentencepiece

    corpus = f"{prefix}.txt"
    with open(corpus, "w", encoding="utf-8") as out:
        out.write(text)
    sentencepiece.SentencePieceTrainer.train(
        input=corpus, model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, minloglevel=2,
        # as Llama-2: text kept as is (no NFKC, no whitespace collapsing), so ids decode to the text
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )
    return f"{prefix}.model"


def learn_byte_merges(text: str, num_merges: int) -> list[bytes]:
    """The tokens of greedy byte-pair merges over the Llama-3 split of `text`, in merge order."""
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(LLAMA3_PAT_STR, text))
    merged = []
    for _ in range(num_merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _count = pairs.most_common(1)[0]
        if a + b not in merged:  # "t"+"he" and "th"+"e" make the same token
            merged.append(a + b)
        words = Counter({_merge(word, a, b): count for word, count in words.items()})
    return merged


def _merge(word: tuple, a: bytes, b: bytes) -> tuple:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_tiktoken_bpe(text: str, path, num_merges: int = 300) -> str:
    """A Llama-3 style tokenizer.model: all 256 bytes, then the learned merges, one
    `<base64 token> <rank>` per line."""
    tokens = [bytes([b]) for b in range(256)] + learn_byte_merges(text, num_merges)
    with open(path, "wb") as out:
        out.writelines(base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate(tokens))
    return str(path)
