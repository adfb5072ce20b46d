"""The tokenizer package's error type (its own module so every tokenizer can raise it)."""
from megatron.errors import ZeroLabError


class TokenizerError(ZeroLabError, ValueError):
    """Missing or inconsistent tokenizer files or flags; the message names the flag/file."""
