"""The chaos bench's moving parts (bench/chaos.py): the two-host job, what its logs say, and the faults.

LogWatch reads the run's logs as they grow; TwoHostJob runs the Z1 driver on both hosts of a virtual cluster;
Injector carries out one fault of each kind on the running job (bench/chaos.py's docstring lists them).
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import resource
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron.checkpointing import protocol
from tools.vcluster import VirtualCluster

REPO = Path(__file__).resolve().parent.parent
HOSTS = ("node0", "node1")
DRIVER = REPO / "examples_zero" / "gpt_deepspeed_Z1.sh"
ITERATION = re.compile(r"^ iteration +(\d+)/ +(\d+) \|.*?\| lm loss: (\S+) \|")
SAVED = re.compile(r"^ ?successfully saved checkpoint at iteration +(\d+) ")
RESTARTING = "[zero-lab] restarting after: "
SKIPPED = re.compile(r"skipped checkpoint (global_step\d+): ")
LOADED = re.compile(r"^  loaded checkpoint \S*?(global_step\d+)\S* at iteration +\d+")  # the path's tag
ATTEMPT = "[zero-lab] attempt "
CUT_AT_MOST_S = 150  # a cut link heals once both hosts restarted (60 s without heartbeats), or after this
RESTART_AT_MOST_S = 300  # a killed background write's run restarts by then, or the bench ends


class ChaosError(RuntimeError):
    """The bench cannot go on (a run failed, a fault was not recovered from): one line."""


@dataclass
class Fault:
    iteration: int  # injected once the run first reaches this iteration (and the fault before it is recovered)
    kind: str
    host: str  # where it lands (cut_link and full_disk: node1; sigterm_job: both)
    injected_at: float | None = None  # monotonic time
    progress_at_fault: int = 0  # the furthest iteration the run had logged when the attempt it ended stopped
    recovered_at: float | None = None  # the first log, in a later attempt, of an iteration past progress_at_fault
    note: str = ""
    resume_from: str | None = None  # the checkpoint the restart must resume (kill_rank_writing: the one before)
    problems: list[str] = field(default_factory=list)  # what the fault's own checks found wrong


@dataclass
class LogWatch:
    """What the run's logs said, read as they grow, each line stamped with when this bench read it."""
    run_dir: Path
    offsets: dict[str, int] = field(default_factory=dict)
    iterations: list[tuple[float, int, str]] = field(default_factory=list)  # (time, iteration, loss as printed)
    saved: set[int] = field(default_factory=set)
    restarts: dict[str, list[str]] = field(default_factory=lambda: {host: [] for host in HOSTS})
    skipped: list[str] = field(default_factory=list)
    loaded: list[tuple[float, str]] = field(default_factory=list)  # (time, the tag an attempt resumed)
    attempts: list[tuple[float, int]] = field(default_factory=list)  # (time, progress then) per attempt header
    last_iteration: int = 0
    total: int = 0

    def poll(self) -> None:
        for host, name in (("node0", "train.log"), ("node1", "train.node1.log")):
            path = self.run_dir / name
            if not path.exists():
                continue
            with open(path, "rb") as log:
                log.seek(self.offsets.get(name, 0))
                chunk = log.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self.offsets[name] = self.offsets.get(name, 0) + len(complete)
            now = time.monotonic()
            for line in complete.decode(errors="replace").splitlines():
                self._read(host, line, now)

    def _read(self, host: str, line: str, now: float) -> None:
        if line.startswith(RESTARTING):
            self.restarts[host].append(line[len(RESTARTING):])
        elif host == "node0" and line.startswith(ATTEMPT):
            self.attempts.append((now, self.progress))
        elif host == "node0" and (match := ITERATION.match(line)):
            self.iterations.append((now, int(match.group(1)), match.group(3)))
            self.last_iteration, self.total = int(match.group(1)), int(match.group(2))
        elif host == "node0" and (match := SAVED.match(line)):
            self.saved.add(int(match.group(1)))
        elif host == "node0" and (match := SKIPPED.search(line)):
            self.skipped.append(match.group(1))
        elif host == "node0" and (match := LOADED.match(line)):
            self.loaded.append((now, match.group(1)))

    @property
    def progress(self) -> int:
        return max((iteration for _, iteration, _ in self.iterations), default=0)

    def recovery(self, since: float) -> tuple[int, float | None] | None:
        """For a fault injected at `since`: None until an attempt starts after it, then (the furthest iteration
        logged before that attempt, when an iteration past it was first logged, or None while none was)."""
        started = next(((t, progress) for t, progress in self.attempts if t >= since), None)
        if started is None:
            return None
        when = next((t for t, i, _ in self.iterations if i > started[1] and t >= started[0]), None)
        return started[1], when


class TwoHostJob:
    """The Z1 driver on node0 and node1 (NNODES=2, one rank each), each in a session of its own."""

    def __init__(self, cluster: VirtualCluster, env: dict, args: list[str], output: Path):
        self.cluster, self.env, self.args, self.output = cluster, env, args, output
        self.drivers: dict[str, subprocess.Popen] = {}
        self.launches = 0

    def start(self) -> None:
        self.launches += 1
        for node_rank, host in enumerate(HOSTS):
            with open(self.output.with_suffix(f".{host}.out"), "a") as out:
                self.drivers[host] = self.cluster.popen(
                    host, ["bash", str(DRIVER), *self.args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, env={**self.env, "NODE_RANK": str(node_rank)})

    def running(self) -> bool:
        return any(driver.poll() is None for driver in self.drivers.values())

    def returncodes(self) -> dict[str, int | None]:
        return {host: driver.poll() for host, driver in self.drivers.items()}

    def signal_all(self, signum: int) -> None:
        for driver in self.drivers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, signum)

    def rank_pid(self, host: str) -> int | None:
        """The training rank's process on `host` (not torchrun's agent, whose command line names the script too)."""
        for pid in self.cluster.pids_in(host):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if any(arg.endswith(b"pretrain_gpt.py") for arg in argv) and b"torch.distributed.run" not in argv:
                    return pid
        return None

    def tail(self) -> str:
        return "\n".join(f"--- {host}: " + self.output.with_suffix(f".{host}.out").read_text()[-1500:]
                         for host in HOSTS if self.output.with_suffix(f".{host}.out").exists())

    def end(self) -> None:
        self.signal_all(signal.SIGKILL)
        for host in HOSTS:  # what the drivers started and left (their sessions are gone with SIGKILL)
            for pid in self.cluster.pids_in(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for driver in self.drivers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                driver.wait(timeout=30)


class Injector:
    """Carries out one fault on the running job; returns a note of what it did."""

    def __init__(self, cluster: VirtualCluster, job: TwoHostJob, watch: LogWatch, rng: random.Random):
        self.cluster, self.job, self.watch, self.rng = cluster, job, watch, rng
        self.checkpoints = watch.run_dir / "checkpoints"

    def __call__(self, fault: Fault) -> str:
        return getattr(self, fault.kind)(fault)

    def _kill_rank(self, host: str) -> int:
        pid = self._wait_rank(host)
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_rank(self, fault: Fault) -> str:
        return f"SIGKILL to {fault.host}'s rank (pid {self._kill_rank(fault.host)})"

    def kill_rank_saving(self, fault: Fault) -> str:
        deadline = time.monotonic() + 120
        while not any(entry.name.endswith(protocol.STAGING_SUFFIX) for entry in os.scandir(self.checkpoints)):
            if time.monotonic() > deadline:
                raise ChaosError("no checkpoint save began within 120 s")
            time.sleep(0.002)
        saving = [e.name for e in os.scandir(self.checkpoints) if e.name.endswith(protocol.STAGING_SUFFIX)]
        return f"SIGKILL to {fault.host}'s rank (pid {self._kill_rank(fault.host)}) while {saving} was written"

    def kill_rank_writing(self, fault: Fault) -> str:
        """An --async-save run: SIGKILL to the rank once its writer thread has opened its optimizer-state file in
        the save's staging folder (only that thread writes files there, while training goes on); then, when the
        job restarts, before it saves again: `latest` and the resume rule still name the checkpoint before, and
        the killed write committed nothing."""
        name = f"zero_pp_rank_{HOSTS.index(fault.host)}_mp_rank_00_optim_states.pt"
        began, deadline = time.time(), time.monotonic() + 120
        while (file := self._new_file(name, began)) is None:
            if time.monotonic() > deadline:
                raise ChaosError(f"no background write of {name} began within 120 s")
            time.sleep(0.002)
        previous = protocol.read_latest(str(self.checkpoints))  # this write's predecessor, committed before it began
        tag = file.parent.name[:-len(protocol.STAGING_SUFFIX)]
        committed = self._marker_time(tag)  # a folder of that name an earlier attempt committed, if any
        pid = self._kill_rank(fault.host)
        written = file.stat().st_size
        fault.resume_from = previous
        self._wait_restart(fault.injected_at)
        latest = protocol.read_latest(str(self.checkpoints))
        if latest != previous:
            fault.problems.append(f"'latest' names {latest}, not {previous}, after the kill")
        if self._marker_time(tag) != committed or (file.parent / protocol.MARKER).exists():
            fault.problems.append(f"the killed write of {tag} was committed")
        if previous and (resumable := protocol.check_resumable(str(self.checkpoints))) != previous:
            fault.problems.append(f"the resume rule takes {resumable}, not {previous}")
        return (f"SIGKILL to {fault.host}'s rank (pid {pid}) at iteration {self.watch.progress} while its writer "
                f"thread wrote {tag}.saving/{name} ({written} bytes of it on disk); 'latest' named {previous}")

    def _new_file(self, name: str, since: float) -> Path | None:
        """`<tag>.saving/<name>`, once a save created or wrote it after `since` (an earlier save's are older)."""
        for entry in os.scandir(self.checkpoints):
            path = Path(entry.path) / name
            if entry.name.endswith(protocol.STAGING_SUFFIX) and path.exists():
                with contextlib.suppress(OSError):
                    if path.stat().st_ctime >= since:
                        return path
        return None

    def _marker_time(self, tag: str) -> int | None:
        """When `tag`'s committed folder got its marker (None: no committed folder of that name)."""
        with contextlib.suppress(OSError):
            return (self.checkpoints / tag / protocol.MARKER).stat().st_mtime_ns
        return None

    def _wait_restart(self, since: float) -> None:
        """Until node0's driver starts its next attempt (before that attempt can save anything)."""
        deadline = time.monotonic() + RESTART_AT_MOST_S
        while not any(t >= since for t, _ in self.watch.attempts):
            if time.monotonic() > deadline:
                raise ChaosError(f"the job did not restart within {RESTART_AT_MOST_S} s of the kill")
            self.watch.poll()
            time.sleep(0.05)

    def cut_link(self, fault: Fault) -> str:
        before = {host: len(lines) for host, lines in self.watch.restarts.items()}
        start = time.monotonic()
        self.cluster.cut("node1")
        try:  # until both hosts have given the other up and restarted
            while any(len(self.watch.restarts[host]) == before[host] for host in HOSTS) and \
                    time.monotonic() - start < CUT_AT_MOST_S:
                self.watch.poll()
                time.sleep(0.2)
        finally:
            self.cluster.heal("node1")
        return f"node1's link cut for {time.monotonic() - start:.0f} s"

    def sigterm_job(self, fault: Fault) -> str:
        self.job.signal_all(signal.SIGTERM)
        return "SIGTERM to both hosts' jobs; started again as a requeue when they had stopped"

    def full_disk(self, fault: Fault) -> str:
        limit = 1 << 20  # below one rank's optimizer shard (tiny: ~40 MB), above anything else a rank writes
        pid = self._wait_rank(fault.host)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, limit))
        return f"file-size limit of 1 MiB on {fault.host}'s rank (pid {pid}) before its next save"

    def flip_byte(self, fault: Fault) -> str:
        before = protocol.read_latest(str(self.checkpoints))
        deadline = time.monotonic() + 120
        while (tag := protocol.read_latest(str(self.checkpoints))) == before:
            if time.monotonic() > deadline:
                raise ChaosError("no new checkpoint within 120 s to damage")
            time.sleep(0.01)
        folder = self.checkpoints / tag
        files = sorted(protocol.read_marker(str(folder)).get(protocol.CHECKSUMS, {}))
        if not files:
            raise ChaosError(f"{folder}: its marker lists no checksums")
        name = self.rng.choice(files)
        size = (folder / name).stat().st_size
        offset = self.rng.randrange(size)
        with open(folder / name, "r+b") as shard:
            shard.seek(offset)
            byte = shard.read(1)
            shard.seek(offset)
            shard.write(bytes([byte[0] ^ 0xFF]))
        pid = self._kill_rank(fault.host)
        return f"byte {offset} of {tag}/{name} flipped, then SIGKILL to {fault.host}'s rank (pid {pid})"

    def _wait_rank(self, host: str) -> int:
        """The training rank's pid on `host`, once there is one (a restarted attempt may still be starting)."""
        deadline = time.monotonic() + 60
        while (pid := self.job.rank_pid(host)) is None:
            if time.monotonic() > deadline:
                raise ChaosError(f"no training rank found on {host}")
            time.sleep(0.05)
        return pid
