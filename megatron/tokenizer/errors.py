"""The tokenizer package's error type (its own module so every tokenizer can raise it)."""


class TokenizerError(ValueError):
    """Missing or inconsistent tokenizer files or flags; the message names the flag/file."""
