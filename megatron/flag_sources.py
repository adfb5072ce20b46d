"""Error messages name the launch script's variable a flag came from.

The launch scripts turn environment variables into Megatron flags (GLOBAL_BATCH -> --global-batch-size,
SP=1 -> --sequence-parallel); a message about the flag alone leaves the user to find which variable to
change. The scripts pass ZERO_LAB_FLAG_SOURCES="--global-batch-size=GLOBAL_BATCH --sequence-parallel=SP ...",
and `name_sources` adds "(from GLOBAL_BATCH)" after each flag (and its value) the message names; where it
names the flag with another value as well (a checkpoint's), only the given value gets it. A flag
that appears more than once in the command line was given again by the user's own extra arguments, which
win: it is left as it is, since it is what they typed.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

ENV = "ZERO_LAB_FLAG_SOURCES"


def _sources(environ: Mapping[str, str]) -> dict[str, str]:
    pairs = (word.split("=", 1) for word in environ.get(ENV, "").split() if "=" in word)
    return {flag: variable for flag, variable in pairs if flag.startswith("--") and variable}


def _value(flag: str, argv: list[str]) -> str | None:
    """The single value the command line gives `flag`, if any."""
    for index, word in enumerate(argv):
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
        if word == flag and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            return argv[index + 1]
    return None


def _mention(message: str, flag: str, value: str | None) -> re.Match | None:
    """Where the message names the flag as the user gave it: with the given value when it names that, else the
    first mention that gives the flag no other number. A message may name the flag twice, the saved
    checkpoint's value beside the given one (--moe-expert-parallel-size 1 when saved, 2 in this run): the
    variable belongs to the given value only."""
    bare = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"
    if value:
        given = re.search(rf"{bare} {re.escape(value)}(?![\w.-])", message)
        if given:
            return given
    return re.search(rf"{bare}(?! -?\d)", message)


def name_sources(message: str, argv: list[str], environ: Mapping[str, str] = os.environ) -> str:
    for flag, variable in _sources(environ).items():
        given = sum(word == flag or word.startswith(flag + "=") for word in argv)
        if given != 1:
            continue
        found = _mention(message, flag, _value(flag, argv))
        if found:
            message = f"{message[:found.end()]} (from {variable}){message[found.end():]}"
    return message
