"""One attempt of a run: start the launcher, keep its output, and end with the cause when it fails.

    python -m megatron.launch.attempt --run-dir RUN --log LOG --launcher NAME [--note TEXT] -- LAUNCH COMMAND...

The launch planner (megatron/launch/plan.py) runs every launch path's launcher through this, in place of `tee`:
- the attempt is numbered, and `RUN/command.txt` gets `# attempt N | <UTC time> | <host>` and the command,
  appended (a resumed run keeps every attempt's command); LOG gets `[zero-lab] attempt N started ...`
  and then everything the ranks print, appended (a resumed run keeps every attempt's output);
- the launcher's own lines (banners, log records, its failure report) go to `RUN/launcher.log`, not to
  the console or LOG (megatron/launch/launcher_output.py tells them apart);
- the ranks' `error:` lines are not shown as they come: when the launch fails, the last line printed is
  the one cause (`error: <cause> (launcher's report: RUN/launcher.log)`), once; the exit status is 1 when
  the cause is a rank's own `error:` line (bad input), else the launcher's;
- a launcher that outlives its failed ranks (torchrun's agent waiting on a rendezvous store behind a cut link)
  is stopped, with what it started, LINGER_SECONDS after a rank reported its failure, so that a lost host
  ends the job on every host;
- SIGTERM or SIGINT to the job's whole process group (a PBS walltime, Slurm's --signal, Ctrl-C) does not
  stop this process: the ranks' `--exit-signal-handler` saves and exits, the launcher ends, and this
  process reads their output to the end. When the ranks stopped on the signal with a checkpoint saved,
  the attempt exits 0 even if the signalled launcher (torchrun) exits non-zero;
- with --restartable (MAX_RESTARTS, restarts left), a failure of a fault the next attempt
  can get past (megatron/launch/restart.py) is said in LOG (`[zero-lab] restarting after: <cause>`) and the
  attempt exits RESTART_STATUS: the planner then starts the run again by the one resume rule; a launcher
  that gave up waiting for the other hosts at its rendezvous exits HOSTS_MISSING_STATUS instead (host 0 then
  goes on with the hosts left).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

from megatron.launch.launcher_output import LAUNCHER, OutputSorter, failure_cause
from megatron.launch.restart import (HOSTS_MISSING_CAUSE, HOSTS_MISSING_STATUS, RESTART_LINE, RESTART_STATUS,
                                     hosts_missing, recurring_failure, worth_restarting)

ATTEMPT_HEADER = "[zero-lab] attempt {number} started {time} UTC on {host}{note}"
_COMMAND_HEADER = re.compile(r"^# attempt (\d+) \|", re.M)
_STOPPED = re.compile(r"^ exiting program after receiving (\w+) at iteration (\d+) \(checkpoint saved to .*\)$")
_TAIL_LINES = 400  # of the ranks' output, kept to find the exception a rank died of
# A launcher still running this long after a rank reported its failure is stopped: launchers end in seconds
# after a rank fails (torchrun gives the other ranks 30 s), unless they wait on a host that is gone.
LINGER_SECONDS = 45


def next_attempt(command_file: str) -> int:
    if not os.path.isfile(command_file):
        return 1
    with open(command_file) as handle:
        return 1 + len(_COMMAND_HEADER.findall(handle.read()))


class Attempt:
    def __init__(self, run_dir: str, log: str, launcher: str, note: str | None, node: str | None = None,
                 restartable: bool = False):
        """node: a further host's launcher in a run over several (its files get the node's name); restartable:
        a failure worth restarting exits RESTART_STATUS."""
        self.run_dir, self.launcher, self.restartable = run_dir, launcher, restartable
        self.report_path = os.path.join(run_dir, f"launcher.{node}.log" if node else "launcher.log")
        self.command_file = os.path.join(run_dir, f"command.{node}.txt" if node else "command.txt")
        self.number = next_attempt(self.command_file)
        self.started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        self.header = ATTEMPT_HEADER.format(number=self.number, time=self.started, host=socket.gethostname(),
                                            note=f": {note}" if note else "")
        self.log = open(log, "a", buffering=1, encoding="utf-8")
        self.report = None  # opened at the launcher's first line
        self.first_error: str | None = None
        self.tail: collections.deque = collections.deque(maxlen=_TAIL_LINES)
        self.report_lines: list[str] = []
        self.stopped_on: str | None = None  # the signal the ranks saved and stopped on
        self.signalled: str | None = None  # the signal this process received
        self.process: subprocess.Popen | None = None
        self.watchdog: threading.Timer | None = None
        self.stopped_lingering = False

    def record_command(self, command: list[str]) -> None:
        with open(self.command_file, "a") as handle:
            handle.write(f"# attempt {self.number} | {self.started} UTC | {socket.gethostname()}\n"
                         f"{shlex.join(command)}\n")
        self.log.write(self.header + "\n")

    def _launcher_line(self, line: str) -> None:
        if self.report is None:
            self.report = open(self.report_path, "a", buffering=1, encoding="utf-8")
            self.report.write(self.header + "\n")
        self.report.write(line + "\n")
        if len(self.report_lines) < 2000:
            self.report_lines.append(line)

    def _rank_line(self, line: str) -> None:
        self.log.write(line + "\n")
        self.tail.append(line)
        if line.startswith("error: "):
            self.first_error = self.first_error or line
            self._watch_the_launcher()
            return  # shown once, as the cause, when the launch has failed
        stopped = _STOPPED.match(line)
        if stopped:
            self.stopped_on = stopped.group(1)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def take(self, labelled: list[tuple[str, str]]) -> None:
        for owner, line in labelled:
            (self._launcher_line if owner == LAUNCHER else self._rank_line)(line)

    def _watch_the_launcher(self) -> None:
        if self.watchdog is None:
            self.watchdog = threading.Timer(LINGER_SECONDS, self._stop_the_launcher)
            self.watchdog.daemon = True
            self.watchdog.start()

    def _stop_the_launcher(self) -> None:
        """The launcher and everything it started: SIGTERM, then SIGKILL to what is left 10 s later."""
        if self.process is None or self.process.poll() is not None:
            return
        self.stopped_lingering = True
        try:
            tree = [psutil.Process(self.process.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.terminate()
        _, alive = psutil.wait_procs(tree, timeout=10)
        for member in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()

    def run(self, command: list[str], env: dict[str, str] | None = None) -> int:
        """env: the launcher's environment (default: this process's)."""
        def remember(signum, frame):
            self.signalled = signal.Signals(signum).name
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, remember)  # the ranks and the launcher got it too: read their output to the end
        self.record_command(command)
        sorter = OutputSorter()
        try:
            process = self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL, env=env)
        except OSError as err:
            return self.fail(f"cannot start {command[0]} ({err.strerror})", 127)
        for raw in process.stdout:
            self.take(sorter.feed(raw.decode("utf-8", errors="replace").rstrip("\r\n")))
        self.take(sorter.flush())
        status = process.wait()
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.stopped_lingering:
            print(f"[run] {self.launcher} was still running {LINGER_SECONDS} s after a rank failed: stopped it and "
                  f"what it started (its report: {self.report_path})", flush=True)
        # a launcher stopped after a rank failed may still exit 0 (torchrun does when its own rendezvous store
        # is on a host that is gone): the attempt failed all the same
        if status == 0 and not self.stopped_lingering:
            return 0
        if self.stopped_on is not None and self.signalled is not None:
            print(f"[run] the ranks saved a checkpoint and stopped on {self.stopped_on}; {self.launcher} then exited "
                  f"with status {status} (its report: {self.report_path}): this attempt ends with 0", flush=True)
            return 0
        rank_lines = ([self.first_error] if self.first_error else []) + list(self.tail)
        cause, users_mistake = failure_cause(rank_lines, self.report_lines, self.launcher, status)
        recurring = recurring_failure(self.first_error, list(self.tail))
        if recurring is not None:
            cause, users_mistake = f"a rank {recurring[0]}: {recurring[1]} (its traceback is in the log)", False
        if not self.first_error and hosts_missing(self.report_lines):
            cause = HOSTS_MISSING_CAUSE
            if self.restartable:  # the planner decides whether the hosts left go on
                self.log.write(RESTART_LINE.format(cause=cause) + "\n")
                return self.fail(cause, HOSTS_MISSING_STATUS)
        if self.restartable:
            restart, why = worth_restarting(self.first_error, self.signalled, recurring)
            if restart:
                self.log.write(RESTART_LINE.format(cause=cause) + "\n")
                return self.fail(cause, RESTART_STATUS)
            print(f"[run] not restarting (MAX_RESTARTS): {why}", flush=True)
        # a rank's error line is a mistake the user can fix: exit 1, whatever the launcher made of it (srun
        # reports 143 for the ranks it stopped after the first failed); else the launcher's own status
        return self.fail(cause, 1 if users_mistake else status if status > 0 else 128 - status)

    def fail(self, cause: str, status: int) -> int:
        where = f" (launcher's report: {self.report_path})" if self.report is not None else ""
        print(f"error: {cause}{where}", file=sys.stderr, flush=True)
        return status

    def close(self) -> None:
        self.log.close()
        if self.report is not None:
            self.report.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="the run folder (command.txt, launcher.log)")
    parser.add_argument("--log", required=True, help="the log the ranks' output is appended to")
    parser.add_argument("--launcher", required=True, help="the launcher's name, for messages")
    parser.add_argument("--note", default=None, help="said in the attempt's header line (e.g. what it resumes)")
    parser.add_argument("--node", default=None, help="a further host's launcher: launcher.NODE.log, command.NODE.txt")
    parser.add_argument("--restartable", action="store_true",
                        help=f"exit {RESTART_STATUS} when the attempt failed of a fault worth restarting")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command")
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no launch command after --")
    os.makedirs(ns.run_dir, exist_ok=True)
    attempt = Attempt(ns.run_dir, ns.log, ns.launcher, ns.note, ns.node, ns.restartable)
    try:
        return attempt.run(command)
    finally:
        attempt.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
