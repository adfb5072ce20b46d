"""The launch planner: the environment and the arguments of a launch script in, one run out.

Every launch script (examples_zero/gpt_deepspeed_*.sh, ALCF/train-gpt3.sh, examples_zero/slurm/train.sbatch) is a
few lines that find Python (scripts/plan.sh) and run `python -m megatron.launch.cli` (the paths' entry). One
process, without torch, does what a launch is:
- the path's own rules turn the variables into a `Launch` (megatron/launch/drivers.py, alcf.py; the training
  settings both share are megatron/launch/settings.py), or one `error:` line naming the variable, exit 1;
- the run lock (one launch per run folder), the one resume rule (megatron/checkpointing/run_folder.py, FRESH=1);
- DRY_RUN=1 prints the command and starts nothing;
- otherwise one attempt of the run (megatron/launch/attempt.py), and with MAX_RESTARTS=N up to N more: an attempt
  that failed of a fault the next one can get past is planned again (the resume rule then resumes the newest intact
  checkpoint; FRESH=1 applies to the first start only), and when the other hosts of a torchrun run do not come back
  within HOST_WAIT_SECONDS, host 0 goes on alone through --universal-checkpoint, the global batch kept.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

from megatron.checkpointing import run_folder
from megatron.errors import ZeroLabError
from megatron.launch.settings import LaunchError

REPO = Path(__file__).resolve().parents[2]
# A further host of a torchrun run restarts this long after its attempt failed: host 0's launcher holds the
# rendezvous store and ends its own failed attempt first (it notices the lost rank within seconds); a host k that
# came back sooner would join the old store as it closes, and fail once more for nothing.
HOST_K_RESTART_DELAY_SECONDS = 10


@dataclass
class Launch:
    """One attempt of a run, planned: what to start, where its output goes, and what to say."""
    run_dir: str
    command: list[str]
    launcher: str  # torchrun, deepspeed, srun or mpiexec: named in messages
    log: str  # the ranks' output, appended
    env: dict[str, str]  # the launcher's environment
    dry_run_line: str  # how DRY_RUN=1 prints the command
    note: str = "fresh start"  # the attempt header's note
    node: str | None = None  # a further host of a torchrun run: its launcher files are named after it
    # restarts: the variables to change when the other hosts are gone and this host goes on alone (None: it cannot)
    alone: dict[str, str] | None = None
    prepare: list[Callable[[], None]] = field(default_factory=list)  # run before the first attempt, not in a dry run


class Planner(Protocol):
    """A launch path (drivers.DriverPlanner, alcf.AlcfPlanner): `plan` gives the Launch of one attempt, taking the
    run lock through `supervisor.take_lock` and applying the resume rule when not a dry run."""
    def plan(self, env: dict[str, str], args: list[str], dry_run: bool,
             supervisor: "Supervisor | None" = None) -> Launch: ...


def die(message: str) -> None:
    raise LaunchError(message)


def python_of(env: Mapping[str, str]) -> str:
    """The Python the ranks run: scripts/plan.sh's PYTHON, which runs this too; it must have torch."""
    python = env.get("PYTHON") or sys.executable
    if importlib.util.find_spec("torch") is None:
        die(f"PYTHON={python} cannot import torch: run 'bash scripts/setup.sh' (it makes {REPO}/.venv), then "
            f"'source {REPO}/.venv/bin/activate'; or set PYTHON to a Python that has torch")
    return python


def visible_gpus(env: Mapping[str, str]) -> int:
    """The GPUs this host's ranks would see, without importing torch: none without an NVIDIA driver; else those
    CUDA_VISIBLE_DEVICES names (when set), else every GPU nvidia-smi lists."""
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if smi is not None:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout
        installed = sum(line.startswith("GPU ") for line in listed.splitlines())
    else:
        installed = len(os.listdir("/proc/driver/nvidia/gpus")) if os.path.isdir("/proc/driver/nvidia/gpus") else 0
    if installed == 0 or "CUDA_VISIBLE_DEVICES" not in env:
        return installed
    return len([gpu for gpu in env["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()])


def gpu_memory_bytes(env: Mapping[str, str]) -> int | None:
    """The memory of the smallest GPU this host's ranks would see (those CUDA_VISIBLE_DEVICES names by index, else
    every one), from nvidia-smi without importing torch; None where nvidia-smi gives none."""
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if smi is None:
        return None
    listed = subprocess.run([smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True).stdout
    mib = {}
    for line in listed.splitlines():
        index, _, total = line.partition(",")
        if index.strip().isdigit() and total.strip().isdigit():
            mib[index.strip()] = int(total.strip())
    visible = [gpu.strip() for gpu in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip()]
    if visible and all(gpu in mib for gpu in visible):
        mib = {gpu: mib[gpu] for gpu in visible}
    return min(mib.values()) * 2**20 if mib else None


def free_port() -> str:
    """A TCP port no process listens on now, from the kernel (bind to port 0), as `torchrun --standalone` takes
    one: a single-host run without MASTER_PORT does not meet another run at 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return str(probe.getsockname()[1])


def check_port(port: str) -> None:
    """Refuse MASTER_PORT when a process on this host listens on it: the ranks' rendezvous store would fail to
    listen there (EADDRINUSE) after the launcher started. SO_REUSEADDR as torch's store binds, so a port whose last
    connections wait out TIME_WAIT counts as free, as it is for the store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port)))
        except OSError as err:
            die(f"MASTER_PORT={port}: the port is in use on this host ({err.strerror}; another run's?): set another "
                "MASTER_PORT, or leave it unset on a single host for a free one")


def given(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that are set and not empty (an empty variable counts as unset, as the scripts read it)."""
    return {name: value for name, value in env.items() if value}


class RunLock:
    """One launch of a run folder at a time: `flock` on RUN/NAME, held by this process until it ends (a restart keeps
    it). The file says who holds it; a refused launch does not erase that."""
    def __init__(self, run_dir: str, name: str):
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, name)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not truncated: the holder's line stays
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with open(path) as handle:
                holder = handle.readline().strip() or f"holding {path}"
            os.close(self.fd)
            die(f"run folder {run_dir} is in use by another launch ({holder}): wait for it to end or stop it; a "
                "second launch would mix its checkpoints and logs with the first's")
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)


def resume_rule(run_dir: str, fresh: bool, dry_run: bool, env: Mapping[str, str]) -> str | None:
    """The checkpoint folder to resume (--load), or None for a fresh start; says what it decided on stderr."""
    try:
        load, said = run_folder.decide(run_dir, fresh, dry_run, environ=env)
    except (ZeroLabError, OSError) as err:
        die(str(err))
    if env.get("DRY_RUN") == "1":  # the dry run's own line says "not starting": this one must not say "starting"
        said = f"DRY_RUN=1, the run would be {said}"
    print(f"[run] {said}", file=sys.stderr, flush=True)
    return load


class Supervisor:
    """The attempts of one run, in this process: the lock taken once, each attempt planned afresh."""
    def __init__(self, planner: Planner, env: dict[str, str], args: list[str]):
        self.planner, self.env, self.args = planner, env, args
        self.max_restarts = int(env.get("MAX_RESTARTS") or 0)
        self.lock: RunLock | None = None

    def take_lock(self, run_dir: str, name: str) -> None:
        if self.lock is None:
            self.lock = RunLock(run_dir, name)

    def run(self) -> int:
        from megatron.launch import attempt as attempts  # psutil: only a real launch needs it
        from megatron.launch.restart import HOSTS_MISSING_STATUS, RESTART_STATUS

        restart = 0
        while True:
            launch = self.planner.plan(self.env, self.args, dry_run=False, supervisor=self)
            if restart == 0:
                for step in launch.prepare:
                    step()
            note = launch.note if restart == 0 else f"restart {restart} of {self.max_restarts}, {launch.note}"
            os.makedirs(launch.run_dir, exist_ok=True)
            attempt = attempts.Attempt(launch.run_dir, launch.log, launch.launcher, note, launch.node,
                                       restartable=restart < self.max_restarts)
            handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
            try:
                status = attempt.run(launch.command, env=launch.env)
            finally:
                attempt.close()
                for signum, handler in handlers.items():  # the attempt only noted signals while its ranks ran
                    signal.signal(signum, handler)
            signalled = attempt.signalled is not None
            if status == RESTART_STATUS and not signalled:
                restart += 1
                if launch.node is not None:
                    print(f"[run] {launch.node} restarts in {HOST_K_RESTART_DELAY_SECONDS} s, once host 0 (which holds "
                          "the rendezvous) has ended its attempt", flush=True)
                    time.sleep(HOST_K_RESTART_DELAY_SECONDS)
                print(f"[run] restarting the run from its newest intact checkpoint ({restart} of {self.max_restarts}, "
                      "MAX_RESTARTS)", flush=True)
                self.env["FRESH"] = "0"
                continue
            if status == HOSTS_MISSING_STATUS and not signalled:
                if launch.alone is not None:
                    restart += 1
                    batch = launch.alone.get("GLOBAL_BATCH")
                    print(f"[run] the other hosts did not come back within HOST_WAIT_SECONDS="
                          f"{self.env.get('HOST_WAIT_SECONDS') or 600} s: going on with this host alone (NNODES=1, "
                          f"NGPUS={launch.alone['NGPUS']}) from the newest intact checkpoint through "
                          f"--universal-checkpoint{f', the global batch kept at {batch}' if batch else ''} "
                          f"({restart} of {self.max_restarts}, MAX_RESTARTS)", flush=True)
                    self.env.update(launch.alone, FRESH="0")
                    self.args = [*self.args, "--universal-checkpoint"]
                    continue
                print(f"[run] host 0 did not come back: host {self.env.get('NODE_RANK')} cannot go on without it (it "
                      "holds the run folder's rendezvous); start the run again from host 0", file=sys.stderr)
            return 1 if status in (RESTART_STATUS, HOSTS_MISSING_STATUS) else status


def launch(planner: Planner, env: dict[str, str], args: list[str]) -> int:
    """Plan the run; DRY_RUN=1 prints it, else the supervisor runs it."""
    dry_run = env.get("DRY_RUN", "0") == "1"
    if dry_run:
        launch_plan = planner.plan(env, args, dry_run=True)
        print(launch_plan.dry_run_line, flush=True)
        return 0
    return Supervisor(planner, env, args).run()
