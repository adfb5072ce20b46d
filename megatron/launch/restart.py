"""Whether a failed attempt of a run is worth starting again (MAX_RESTARTS, docs/faults.md).

A fault that the next attempt can get past is restarted: a rank or a host lost (killed, cut off: the ranks left
say `error: lost rank ...`), a rank that died without an error line of its own (a signal, the out-of-memory
killer, a crash), a save that could not be written (a full disk). A failure that would fail again is not: a
rank's own error line about the input (a flag, the data, a checkpoint it refuses, a run that diverged) ends the
run at once with that line, and so does a signal the job itself was sent (a scheduler stopping it).
"""
from __future__ import annotations

import re

# the exit status of an attempt that failed of a fault worth restarting (sysexits' EX_TEMPFAIL), given only
# when the caller has restarts left (megatron/launch/attempt.py --restartable)
RESTART_STATUS = 75
# the exit status of an attempt whose launcher gave up waiting for the other hosts at the rendezvous (a host gone for
# good): host 0 of a run over several hosts may then go on with the hosts left (scripts/launch_common.sh)
HOSTS_MISSING_STATUS = 76
# torchrun's error when the hosts did not all join its rendezvous within join_timeout (HOST_WAIT_SECONDS)
_RENDEZVOUS_TIMEOUT = "RendezvousTimeoutError"
HOSTS_MISSING_CAUSE = "the other hosts did not join the rendezvous within HOST_WAIT_SECONDS"

# the log's line for a restart, after the failed attempt's output (not an attempt header: analysis and
# examples_zero/slurm/train.sbatch split the log at "[zero-lab] attempt ")
RESTART_LINE = "[zero-lab] restarting after: {cause}"

# rank error lines that a fault causes, not the input: the ranks left after a peer is gone
# (megatron/launch/lost_peer.py, heartbeat.py) and a save the disk refused (megatron/checkpointing/save_load.py)
_FAULT_LINES = (re.compile(r"^error: lost ranks? "),
                re.compile(r"^error: --save \S+: writing checkpoint \S+ failed on rank \d+ "))


def worth_restarting(first_error: str | None, signalled: str | None) -> tuple[bool, str]:
    """(restart?, why) for an attempt that failed: its first rank `error:` line (None: no rank said one) and
    the signal the job was sent while it ran (None: none)."""
    if signalled is not None:
        return False, f"the job was sent {signalled}: not restarting"
    if first_error is None:
        return True, "a rank ended without an error line of its own (a signal, a crash)"
    if any(pattern.match(first_error) for pattern in _FAULT_LINES):
        return True, first_error[len("error: "):]
    return False, "a rank's own error line: the next attempt would fail the same way"


def hosts_missing(launcher_report: list[str]) -> bool:
    """Whether the launcher gave up because hosts did not join its rendezvous (torchrun's join timeout)."""
    return any(_RENDEZVOUS_TIMEOUT in line for line in launcher_report)
