"""Whether a failed attempt of a run is worth starting again (MAX_RESTARTS, docs/faults.md).

A fault that the next attempt can get past is restarted: a rank or a host lost (killed, cut off: the ranks left
say `error: lost rank ...`), a rank that died without an error line of its own (a signal, the out-of-memory
killer, a crash), a save that could not be written (a full disk). A failure that would fail again is not: a
rank's own error line about the input (a flag, the data, a checkpoint it refuses, a run that diverged) ends the
run at once with that line, and so does a signal the job itself was sent (a scheduler stopping it), and an
exception that says the set-up cannot run (`recurring_failure`: out of GPU memory, two ranks on one GPU, a CUDA
op that does not build), though a rank dies of it with a traceback and no error line.
"""
from __future__ import annotations

import re

# the exit status of an attempt that failed of a fault worth restarting (sysexits' EX_TEMPFAIL), given only
# when the caller has restarts left (megatron/launch/attempt.py --restartable)
RESTART_STATUS = 75
# the exit status of an attempt whose launcher gave up waiting for the other hosts at the rendezvous (a host gone for
# good): host 0 of a run over several hosts may then go on with the hosts left (megatron/launch/plan.py)
HOSTS_MISSING_STATUS = 76
# torchrun's error when the hosts did not all join its rendezvous within join_timeout (HOST_WAIT_SECONDS)
_RENDEZVOUS_TIMEOUT = "RendezvousTimeoutError"
HOSTS_MISSING_CAUSE = "the other hosts did not join the rendezvous within HOST_WAIT_SECONDS"

# the log's line for a restart, after the failed attempt's output (not an attempt header: analysis and
# examples_zero/slurm/train.sbatch split the log at "[zero-lab] attempt ")
RESTART_LINE = "[zero-lab] restarting after: {cause}"

# rank error lines that a fault causes, not the input: the ranks left after a peer is gone
# (megatron/runtime/lost_peer.py, heartbeat.py) and a save the disk refused (megatron/checkpointing/save_load.py)
_FAULT_LINES = (re.compile(r"^error: lost ranks? "),
                re.compile(r"^error: --save \S+: writing checkpoint \S+ failed on rank \d+ "))


# What a rank prints when it dies, without an `error:` line, of a failure the same set-up meets again: (what
# the rank did, the line's pattern, a group the part to show). Looked for in this order, so that an op build's
# exception wins over ninja's line before it.
_RECURRING = (
    ("ran out of GPU memory", re.compile(r"(torch\.(?:cuda\.)?OutOfMemoryError(?::.*)?)$")),
    # NCCL's "Last error:" line under its DistBackendError: CUDA_VISIBLE_DEVICES or a launcher's binding gave
    # two ranks one GPU
    ("shares its GPU with another rank", re.compile(r"(Duplicate GPU detected\b.*)")),
    ("could not build a CUDA op", re.compile(r"(RuntimeError: Error building extension '.*)"
                                             r"|(\S*CUDAMismatchException: .*)")),
    ("could not build a CUDA op", re.compile(r"(ninja: build stopped: subcommand failed\.?)")),
)


def _is_fault_line(first_error: str) -> bool:
    return any(pattern.match(first_error) for pattern in _FAULT_LINES)


def recurring_failure(first_error: str | None, rank_lines: list[str]) -> tuple[str, str] | None:
    """(what the rank did, the line naming it) for an exception in the ranks' output that the next attempt would
    die of too (`_RECURRING`); None: none, or a rank's own `error:` line about the input, which says more.
    Indented lines (a traceback's frames and source) are not read."""
    if first_error is not None and not _is_fault_line(first_error):
        return None
    for what, pattern in _RECURRING:
        for line in rank_lines:
            match = None if line[:1].isspace() else pattern.search(line)
            if match:
                return what, next(group for group in match.groups() if group)
    return None


def worth_restarting(first_error: str | None, signalled: str | None,
                     recurring: tuple[str, str] | None = None) -> tuple[bool, str]:
    """(restart?, why) for an attempt that failed: its first rank `error:` line (None: no rank said one), the
    signal the job was sent while it ran (None: none) and what `recurring_failure` found (None: nothing)."""
    if signalled is not None:
        return False, f"the job was sent {signalled}: not restarting"
    if first_error is not None and not _is_fault_line(first_error):
        return False, "a rank's own error line: the next attempt would fail the same way"
    if recurring is not None:  # though the ranks left may say they lost the one that died of it
        return False, f"a rank {recurring[0]}: the next attempt would fail the same way"
    if first_error is None:
        return True, "a rank ended without an error line of its own (a signal, a crash)"
    return True, first_error[len("error: "):]


def hosts_missing(launcher_report: list[str]) -> bool:
    """Whether the launcher gave up because hosts did not join its rendezvous (torchrun's join timeout)."""
    return any(_RENDEZVOUS_TIMEOUT in line for line in launcher_report)
