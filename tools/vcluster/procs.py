"""Processes the cluster owns: found by PID and start time, or by the network namespace they are in.

A PID alone could be reused by an unrelated process after ours exited, so every recorded process
also carries its start time (field 22 of /proc/PID/stat); a PID whose start time differs is not ours.
"""
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces; the rest follows the last ')'.
    return text[text.rindex(")") + 2:].split()


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 overall, 20 after pid and comm


@dataclass
class Proc:
    """One process the cluster started: what it is, where it runs (None: the root namespaces)."""
    name: str
    pid: int
    start: int
    host: str | None = None
    log: str | None = None

    @classmethod
    def of(cls, pid: int, name: str, host: str | None = None, log: str | None = None) -> "Proc":
        started = start_time(pid)
        return cls(name, pid, started if started is not None else -1, host, log)

    def alive(self) -> bool:
        """Running and still the process we started (a zombie has exited: it holds nothing but its PID)."""
        fields = _stat_fields(self.pid)
        return fields is not None and int(fields[19]) == self.start and fields[0] != "Z"


def netns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def pids_in_netns(inodes: set[int]) -> list[int]:
    """Every live process whose network namespace is one of `inodes` (zombies have none and are skipped)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"/proc/{entry.name}/ns/net").st_ino in inodes:
                    found.append(int(entry.name))
            except OSError:
                continue  # exited meanwhile
    return found


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def executable(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def forks_of(pids: set[int], candidates: list[int]) -> set[int]:
    """The candidates that are copies of one of `pids` (a child with its parent's executable, as slurmctld's
    slurmscriptd or sshd's per-connection process), through any number of such copies."""
    forks = set(pids)
    for pid in sorted(candidates):  # parents start before their children, so mostly have lower PIDs
        chain, current = [], pid
        while current not in forks and current not in (None, 0, 1) and len(chain) < 64:
            chain.append(current)
            current = parent_pid(current)
        if current in forks and all(executable(p) == executable(parent_pid(p)) for p in chain):
            forks.update(chain)
    return forks - set(pids)


def _signal(pid: int, start: int, sig: int) -> None:
    if start_time(pid) == start:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(pid: int) -> None:
    """Collect the exit of our own child so it leaves no zombie; other processes are init's to collect."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(procs: list[Proc], grace: float = 5.0, reap: set[int] = frozenset()) -> list[Proc]:
    """SIGTERM, then SIGKILL after `grace` seconds, every process of `procs` still alive; returns the
    ones that would not die. PIDs in `reap` are children of this process to collect when they end."""
    living = [proc for proc in procs if proc.alive()]
    for proc in living:
        _signal(proc.pid, proc.start, signal.SIGTERM)
    for sig, wait in ((signal.SIGKILL, grace), (None, 5.0)):
        deadline = time.monotonic() + wait
        while living and time.monotonic() < deadline:
            for proc in living:
                if proc.pid in reap:
                    _reap(proc.pid)
            living = [proc for proc in living if proc.alive()]
            time.sleep(0.05)
        if sig is not None:
            for proc in living:
                _signal(proc.pid, proc.start, sig)
    for proc in procs:
        if proc.pid in reap:
            _reap(proc.pid)
    return living
