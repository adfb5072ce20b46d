"""--slurm: a real Slurm cluster over the hosts, from Debian's packages and a slurm.conf of our own.

One munged in the root namespaces (its socket in the state folder: a unix socket is reached through
the filesystem, whatever the network namespace), slurmctld inside the first host, and one slurmd per
host inside that host. Configuration, state, spool, logs and the munge key all live in the state
folder; nothing in /etc is touched. slurmctld listens at the first host's address, which only the
hosts can reach, so Slurm's client commands run inside a host: `virtual_cluster.py run node0 -- sinfo`,
or SlurmView.command() from Python.
"""
import os
import re
import subprocess
import time
from pathlib import Path

from .system import ClusterError, apt_install, one_line, sh, tool

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue")
# Every host has its own ports, so the standard ones are free in each of them.
SLURMCTLD_PORT, SLURMD_PORT = 6817, 6818
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")

# Settings for a small test cluster (a requeued job starts again within ~20 s); %n is the node's name, so each slurmd
# of this machine has its own spool, pid file and log.
SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={ctld_name}({ctld_address})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=15
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.%n.pid
SlurmctldLogFile={log}/slurmctld.log
SlurmdLogFile={log}/slurmd.%n.log
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
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE OverSubscribe=NO State=UP
"""


def install() -> None:
    apt_install(PACKAGES, TOOLS)


def node_cpus() -> int:
    """CPUs as slurmd counts them (`slurmd -C`). Every node gets all of them: the hosts share this
    machine's cores, which oversubscribes it, as a rehearsal may."""
    out = subprocess.run([tool("slurmd"), "-C"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"\bCPUs=(\d+)", out)
    return int(match.group(1)) if match else os.cpu_count() or 1


def folder_of(cluster) -> Path:
    return cluster.dir / "slurm"


def write_conf(cluster, munge_socket: Path) -> Path:
    hosts, folder = cluster.state.hosts, folder_of(cluster)
    cpus = node_cpus()
    nodes = "\n".join(f"NodeName={host.name} NodeAddr={host.address} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                      for host in hosts)
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(
        cluster=cluster.name, ctld_name=hosts[0].name, ctld_address=hosts[0].address, ctld_port=SLURMCTLD_PORT,
        slurmd_port=SLURMD_PORT, munge_socket=munge_socket, folder=folder, log=cluster.dir / "log",
        nodes=nodes, node_list=",".join(host.name for host in hosts)))
    return conf


def start(cluster, timeout: float = 90) -> None:
    folder = folder_of(cluster)
    for sub in ("state", "munge", "socket", *(f"spool/{host}" for host in cluster.hosts)):
        (folder / sub).mkdir(parents=True)  # slurmd makes its spool too, but only after complaining
    (folder / "munge").chmod(0o700)   # munged refuses a key others could read
    (folder / "socket").chmod(0o755)  # and a socket folder its clients cannot enter
    folder.chmod(0o755)
    key, socket_path = folder / "munge" / "munge.key", folder / "socket" / "munge.socket"
    sh("mungekey", "--create", f"--keyfile={key}", what="making the munge key")
    view = SlurmView(cluster)
    cluster.start_daemon("munged", [tool("munged"), "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                                    f"--pid-file={folder / 'munge' / 'munged.pid'}",
                                    f"--seed-file={folder / 'munge' / 'seed'}",
                                    f"--log-file={cluster.dir / 'log' / 'munged.log'}"], host=None)
    view.until(socket_path.exists, 20, "munged did not create its socket")
    write_conf(cluster, socket_path)
    env = view.env()
    cluster.start_daemon("slurmctld", [tool("slurmctld"), "-D", "-f", str(view.conf)], cluster.hosts[0], env)
    for host in cluster.hosts:
        cluster.start_daemon("slurmd", [tool("slurmd"), "-D", "-f", str(view.conf), "-N", host], host, env)
    view.until(view.all_idle, timeout, f"the {len(cluster.hosts)} nodes did not all come up idle")


class SlurmView:
    """The Slurm of a virtual cluster, for tests: its configuration, job states, logs; clients run in the first host."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.root = folder_of(cluster)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def host(self) -> str:
        """Where client commands run: the host of slurmctld."""
        return self.cluster.hosts[0]

    def env(self, base: dict | None = None) -> dict:
        """`base` (default os.environ) pointed at this cluster; sbin on PATH for the daemons' tools."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin"
        return env

    def command(self, *args: str, check=True, timeout=60, cwd=None) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, srun, scontrol, ...) run inside the first host."""
        result = self.cluster.run(self.host, list(args), cwd=cwd, env=self.env(), capture_output=True, text=True,
                                  timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
        return result

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, RestartCnt, ...)."""
        out = self.command("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float, states=FINAL_STATES) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s: {self.log_tail()}")
            time.sleep(0.5)

    def node_states(self) -> dict[str, str]:
        result = self.command("sinfo", "--noheader", "--Node", "--format=%N %t", check=False, timeout=20)
        return dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)

    def all_idle(self) -> bool:
        return self.node_states() == {host: "idle" for host in self.cluster.hosts}

    def log_tail(self, lines=20) -> str:
        logs = self.cluster.dir / "log"
        names = ["munged.log", "slurmctld.log"] + [f"slurmd.{host}.log" for host in self.cluster.hosts]
        text = []
        for name in names + sorted(path.name for path in logs.glob("*.out")):
            path = logs / name
            if path.exists() and path.stat().st_size:
                text.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(text)

    def until(self, ready, timeout: float, what: str) -> None:
        """Wait for `ready()`; a daemon that exits, or the timeout, is one error naming what, then the logs."""
        deadline = time.monotonic() + timeout
        while not ready():
            for proc in self.cluster.state.daemons:
                if not proc.alive():
                    raise ClusterError(f"{proc.name}{' on ' + proc.host if proc.host else ''} exited "
                                       f"(log: {proc.log}: {one_line(Path(proc.log).read_text())})\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} within {timeout} s (states: {self.node_states()})\n{self.log_tail()}")
            time.sleep(0.5)
