"""Which lines of a launch's output are the launcher's own, and what made a failed run fail.

torchrun, the deepspeed launcher, MPICH's and Open MPI's mpiexec and srun all print their own report
when a rank fails (torchrun: a 40-line ChildFailedError traceback), in the same stream as the ranks'
output, which holds the one `error:` line that says what went wrong. `OutputSorter` reads that stream
line by line and tells the launcher's lines (its banners, log records, failure reports) from the
ranks'; `failure_cause` picks the line that explains a failure: the ranks' first `error:` line, else the
exception a rank died of, else what the launcher says about the rank it lost.
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

LAUNCHER, RANK = "launcher", "rank"

_LAUNCHER_LINES = re.compile(
    # torchrun's log records: glog style, from torch.distributed.elastic / run.py / launcher
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/(?:elastic|run\.py|launcher)"
    # torchrun's start-up banner about OMP_NUM_THREADS
    r"|^\*{20,}$|^Setting OMP_NUM_THREADS environment variable for each process"
    # the deepspeed launcher's log records
    r"|^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\] \[(?:runner|launch|multinode_runner)\.py:\d+:"
    # MPICH (Hydra): its own messages and the BAD TERMINATION box
    r"|^\[(?:mpiexec|proxy:)[^\]]*\]|^=+$|^=   |^YOUR APPLICATION TERMINATED WITH THE EXIT STRING"
    # Slurm
    r"|^srun: |^slurmstepd(?:-\S+)?: "
)
_OPEN_MPI_RULE = re.compile(r"^-{60,}$")  # Open MPI frames each of its messages between two of these
_LAUNCHER_FRAME = re.compile(r'File ".*(?:torch/distributed/(?:run\.py|elastic|launcher)|deepspeed/launcher)')
_TRACEBACK = "Traceback (most recent call last):"
# torchrun prefixes each line a rank prints on stderr after a failure with "[rankN]: "
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")


@dataclass
class OutputSorter:
    """Feed lines in order; each comes back labelled LAUNCHER or RANK (a traceback comes back whole,
    once its exception line shows whose it is)."""
    in_open_mpi_box: bool = False
    in_child_failed_report: int = 0  # the "====" lines of torchrun's ChildFailedError report still to come
    traceback: list = field(default_factory=list)

    def feed(self, line: str) -> list[tuple[str, str]]:
        line = _RANK_PREFIX.sub("", line)
        if self.traceback:
            self.traceback.append(line)
            if line[:1].isspace() or line == _TRACEBACK:
                return []
            return self._end_traceback()
        if line == _TRACEBACK:
            self.traceback = [line]
            return []
        if self.in_child_failed_report:
            if re.fullmatch(r"=+", line):
                self.in_child_failed_report -= 1
            return [(LAUNCHER, line)]
        if _OPEN_MPI_RULE.match(line):
            self.in_open_mpi_box = not self.in_open_mpi_box
            return [(LAUNCHER, line)]
        if self.in_open_mpi_box or _LAUNCHER_LINES.match(line):
            return [(LAUNCHER, line)]
        return [(RANK, line)]

    def _end_traceback(self) -> list[tuple[str, str]]:
        lines, self.traceback = self.traceback, []
        owner = LAUNCHER if any(_LAUNCHER_FRAME.search(line) for line in lines) else RANK
        if owner == LAUNCHER and "ChildFailedError" in lines[-1]:
            self.in_child_failed_report = 2
        return [(owner, line) for line in lines]

    def flush(self) -> list[tuple[str, str]]:
        """What is still held at the end of the stream (a traceback cut off before its exception)."""
        lines, self.traceback = self.traceback, []
        return [(RANK, line) for line in lines]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _how(status: int) -> str:
    """A process's end as launchers report it: a negative status is the signal that killed it."""
    return f"was killed by {_signal_name(-status)}" if status < 0 else f"exited with status {status}"


def _launcher_says(report: list[str]) -> str | None:
    """What the launcher's report says about the rank it lost, in one phrase (None: nothing usable)."""
    text = "\n".join(report)
    root = text.split("Root Cause (first observed failure):", 1)
    if len(root) == 2:  # torchrun
        rank, code = re.search(r"rank\s*:\s*(\d+)", root[1]), re.search(r"exitcode\s*:\s*(-?\d+)", root[1])
        if rank and code:
            return f"rank {rank[1]} {_how(int(code[1]))}"
    if match := re.search(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)", text):
        return f"task {match[2]} on {match[1]}: {match[3]}"
    if match := re.search(r"EXIT STRING: .*\(signal (\d+)\)", text):  # MPICH (Hydra)
        host = re.search(r"RUNNING AT (\S+)", text)
        return f"a rank{' on ' + host[1] if host else ''} {_how(-int(match[1]))}"
    if match := re.search(r"RUNNING AT (\S+)\n=\s+EXIT CODE: (\d+)", text):
        return f"a rank on {match[1]} {_how(int(match[2]))}"
    if match := re.search(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)", text):  # Open MPI
        return f"rank {match[1]} on {match[2]} {_how(-int(match[3]))}"
    if match := re.search(r"'--local_rank=(\d+)'.*exits with return code = (-?\d+)", text):  # deepspeed
        return f"local rank {match[1]} {_how(int(match[2]))}"
    return None


def failure_cause(rank_lines: list[str], report: list[str], launcher: str, status: int) -> tuple[str, bool]:
    """The one line that says why a failed launch failed (without the `error: ` prefix), and whether it is a
    rank's own error line (a mistake the user can fix: the launch then exits 1, as pretrain_gpt.py does)."""
    for line in rank_lines:
        if line.startswith("error: "):
            return line[len("error: "):], True
    in_use = re.search(r"port: (\d+).*EADDRINUSE", "\n".join([*report, *rank_lines]))
    if in_use:  # the rendezvous store found its port taken between the planner's check and the store's start
        return (f"port {in_use[1]} (MASTER_PORT) is in use on this host (EADDRINUSE; another run's?): set another "
                "MASTER_PORT, or leave it unset on a single host for a free one"), True
    exceptions = [line for previous, line in zip(rank_lines, rank_lines[1:])
                  if previous[:1].isspace() and line and not line[:1].isspace() and re.match(r"[\w.]+(: |$)", line)]
    if exceptions:
        return f"a rank failed with {exceptions[-1]} (its traceback is in the log)", False
    return _launcher_says(report) or f"{launcher} {_how(status)}", False
