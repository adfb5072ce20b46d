"""The tokenizer for a loaded checkpoint: the one recorded in it, or --vocab-file/--merge-file."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from megatron.tokenizer import TokenizerConfig, TokenizerError, build_tokenizer


def resolve_tokenizer(recorded: TokenizerConfig | None, vocab_file: str | None, merge_file: str | None):
    """(tokenizer or None, the TokenizerConfig it was built from or None).

    Flags win over what the checkpoint recorded; a recorded GPT-2 vocabulary that no longer
    exists (the run's data folder moved) gives None with a note, so callers can ask for the flags."""
    if (vocab_file is None) != (merge_file is None):
        raise TokenizerError("give --vocab-file and --merge-file together")
    if vocab_file is not None:
        recorded = replace(recorded or TokenizerConfig(), tokenizer_type="GPT2BPETokenizer",
                           vocab_file=vocab_file, merge_file=merge_file)
    if recorded is None:
        return None, None
    if recorded.tokenizer_type == "GPT2BPETokenizer":
        missing = [path for path in (recorded.vocab_file, recorded.merge_file) if not path or not os.path.isfile(path)]
        if missing and vocab_file is None:
            print(f"note: the checkpoint's tokenizer file {missing[0]} does not exist; "
                  "give --vocab-file and --merge-file", file=sys.stderr)
            return None, None
    return build_tokenizer(recorded, verbose=False), recorded
