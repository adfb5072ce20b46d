"""A real one-node Slurm cluster for the tests: Debian's munged, slurmctld and slurmd, started as root
from a slurm.conf generated in a temporary folder (state, spool, logs, munge key and socket there too),
so nothing in /etc is touched. Installed from Debian when missing. `stop()` cancels the cluster's jobs
and ends exactly the three daemons started here.

    python tests/slurm_cluster.py   # start one by hand; prints SLURM_CONF, stops on Ctrl-C
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


class SlurmUnavailable(RuntimeError):
    """No cluster can be started here; the message says why (the tests skip with it)."""


def _tool(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def install_slurm() -> None:
    """Debian's packages, as scripts/setup.sh installs MPICH: only as root, only what is missing."""
    if all(_tool(name) for name in TOOLS):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root")
    if _tool("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {result.stderr.strip()[-500:]}")
    missing = [name for name in TOOLS if _tool(name) is None]
    if missing:
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but still missing {', '.join(missing)}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_cpus() -> int:
    """CPUs as slurmd itself counts them (`slurmd -C`), so the node registers without a mismatch."""
    out = subprocess.run([_tool("slurmd"), "-C"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"\bCPUs=(\d+)", out)
    return int(match.group(1)) if match else os.cpu_count() or 1


SLURM_CONF = """\
ClusterName=zerolab
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=15
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE OverSubscribe=NO State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    host: str
    cpus: int
    daemons: list = field(default_factory=list)  # (name, Popen) in start order

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: dict | None = None) -> dict:
        """`base` (default os.environ) pointed at this cluster; sbin on PATH for the daemons' tools."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin"
        return env

    def command(self, *args: str, check=True, timeout=60) -> subprocess.CompletedProcess:
        result = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
        return result

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, RestartCnt, ...)."""
        out = self.command("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                          "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s: "
                                   f"{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines=20) -> str:
        text = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                text.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
        return "\n".join(text)

    def _start(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.daemons.append((name, subprocess.Popen([_tool(name), *args], stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, env=self.env())))
        log.close()

    def start(self, timeout=60) -> None:
        for sub in ("state", "spool", "log", "munge", "socket"):
            (self.root / sub).mkdir()
        (self.root / "munge").chmod(0o700)    # munged refuses a key others could read
        (self.root / "socket").chmod(0o755)   # and a socket folder clients cannot enter
        key = self.root / "munge" / "munge.key"
        subprocess.run([_tool("mungekey"), "--create", "--keyfile", str(key)], check=True, timeout=60)
        socket_path = self.root / "socket" / "munge.socket"
        self.conf.write_text(SLURM_CONF.format(host=self.host, root=self.root, cpus=self.cpus,
                                               ctld_port=_free_port(), slurmd_port=_free_port(),
                                               munge_socket=socket_path))
        self._start("munged", "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={self.root / 'munge' / 'munged.pid'}", f"--seed-file={self.root / 'munge' / 'seed'}",
                    f"--log-file={self.root / 'log' / 'munged.log'}")
        self._until(socket_path.exists, timeout, "munged did not create its socket")
        self._start("slurmctld", "-D", "-f", str(self.conf))
        self._start("slurmd", "-D", "-f", str(self.conf), "-N", self.host)
        self._until(self._node_idle, timeout, "the node did not come up idle")

    def _node_idle(self) -> bool:
        result = self.command("sinfo", "--noheader", "--format=%t", check=False)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self.daemons:
                if process.poll() is not None:
                    out = (self.root / "log" / f"{name}.out").read_text()[-2000:]
                    raise SlurmUnavailable(f"{name} exited with {process.returncode}: {out}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"{what} within {timeout} s\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job of this cluster, then end the daemons started here, newest first."""
        if any(name == "slurmctld" and process.poll() is None for name, process in self.daemons):
            self.command("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.command("squeue", "--noheader", check=False).stdout.strip():
                time.sleep(0.5)
        for _, process in reversed(self.daemons):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.daemons.clear()


def start_cluster() -> SlurmCluster:
    """Install if needed and start a cluster in a fresh temporary folder; raises SlurmUnavailable."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("a one-node Slurm cluster needs root (its daemons run as SlurmUser=root)")
    install_slurm()
    root = Path(tempfile.mkdtemp(prefix="zero-lab-slurm-"))
    root.chmod(0o755)  # munged checks that every folder above its socket is open to its clients
    cluster = SlurmCluster(root, socket.gethostname().split(".")[0], _node_cpus())
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


if __name__ == "__main__":
    running = start_cluster()
    print(f"export SLURM_CONF={running.conf}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
