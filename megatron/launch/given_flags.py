"""The layout flags a user gives after a launch script, as Megatron-DeepSpeed's users pass them
(`bash examples_zero/gpt_deepspeed_Z1.sh --ds-sequence-parallel-size 2`), read as the variables that set the same
thing (docs/environment.md), so that the planner's arithmetic (the data-parallel size, the global batch, the MoE
checks, the run's name) is that of the run that starts. The flags stay in the command as the user typed them; a
variable set to another value than its flag is refused in one line naming both.
"""
from __future__ import annotations

import re

from megatron.launch.settings import LaunchError
from megatron.settings_schema import BY_FLAG, LAYOUT, SEVERAL

# flag -> the variable that sets it, and that variable's other name (ALCF's) if any (megatron/settings_schema.py)
LAYOUT_FLAGS = {variable.flags[0]: (variable.name, variable.alias) for variable in LAYOUT}
# a flag without a value (a 0-or-1 variable's): the variable's value it means
SWITCHES = {flag: "1" for flag in LAYOUT_FLAGS if BY_FLAG[flag].kind == "flag"}


def _given(flag: str, args: list[str]) -> str | None:
    """The value of `flag`'s last occurrence in `args` (argparse's rule), its words joined by spaces (the experts
    flag takes one per MoE layer); None when it is not given."""
    found = None
    for index, word in enumerate(args):
        if word.startswith(flag + "="):
            found = word.split("=", 1)[1]
        elif word == flag:
            values = []
            for following in args[index + 1:]:
                if following.startswith("--"):
                    break
                values.append(following)
            found = SWITCHES.get(flag, " ".join(values))
    return found


def read_layout_flags(v: dict[str, str], args: list[str]) -> dict[str, str]:
    """`v` (the variables that are set) with those the layout flags in `args` set; one line where a flag's value is
    not a positive integer, or where a variable gives the same setting another value."""
    v = dict(v)
    for flag, (variable, other) in LAYOUT_FLAGS.items():
        value = _given(flag, args)
        if value is None:
            continue
        if flag not in SWITCHES and not re.fullmatch(r"[1-9][0-9]*( [1-9][0-9]*)*", value) or (
                BY_FLAG[flag].kind not in SEVERAL and " " in value):
            raise LaunchError(f"{flag} {value or '(no value)'} after the launch script: expected a positive integer "
                              f"(or set {variable} instead)")
        for name in filter(None, (variable, other)):
            if name in v and v[name].split() != value.split():
                raise LaunchError(f"{flag} {value} after the launch script and {name}={v[name]} set the same thing "
                                  f"to different values: set one of them ({variable} is the launch's own way)")
        v[variable] = value
    return v
