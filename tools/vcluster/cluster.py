"""VirtualCluster: N hosts made of Linux namespaces on this machine, driven from Python.

    cluster = VirtualCluster.up(hosts=2, name="demo")
    cluster.run("node1", ["hostname"], capture_output=True, text=True).stdout   # 'node1\\n'
    cluster.address("node1")                                                    # '10.250.0.2'
    cluster.cut("node1"); cluster.heal("node1")
    cluster.down()

`VirtualCluster.attach(name)` picks up a cluster that the CLI (or another process) brought up.
"""
import os
import re
import subprocess
import time
from pathlib import Path

from . import hosts as host_setup
from . import network
from . import slurm as slurm_mode
from . import ssh as ssh_mode
from .procs import Proc, netns_inode
from .state import ClusterState, Host, check_name, netns_prefix, state_dir
from .system import ClusterError, require_root_and_namespaces, sh
from .teardown import namespace_inodes, orphaned_namespaces, processes_inside, take_down

HOSTNAME_PREFIX = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


class VirtualCluster:
    def __init__(self, state: ClusterState, children: dict[int, subprocess.Popen] | None = None):
        self.state = state
        self._children = children if children is not None else {}  # started here: reaped here at down

    # ---- bringing one up, finding one ----

    @classmethod
    def up(cls, hosts: int = 2, name: str = "vc", prefix: str = "node", subnet: str = "10.250.0.0/24",
           bandwidth: str | None = None, latency_ms: float | None = None, loopback_hostname: bool = False,
           scratch: str | None = None, slurm: bool = False, ssh: bool = False) -> "VirtualCluster":
        """Make the cluster; on any failure (or Ctrl-C) take apart what was made, then raise."""
        require_root_and_namespaces()
        check_name(name)
        if not HOSTNAME_PREFIX.match(prefix):
            raise ClusterError(f"--prefix {prefix!r}: expected a lowercase letter then letters, digits or '-'")
        if hosts < 1:
            raise ClusterError(f"--hosts {hosts}: expected at least 1")
        if bandwidth:
            network.parse_rate(bandwidth)
        if latency_ms is not None and latency_ms < 0:
            raise ClusterError(f"--latency {latency_ms}: expected milliseconds >= 0")
        if scratch is not None and not scratch.startswith("/"):
            raise ClusterError(f"--scratch-path {scratch!r}: expected an absolute path")
        addresses, prefix_len = network.host_addresses(subnet, hosts)
        folder = state_dir(name)
        if (folder / "state.json").exists():
            raise ClusterError(f"cluster {name} is already up (state in {folder}): run down first, or pick --name")
        if orphaned_namespaces(netns_prefix(name)):
            raise ClusterError(f"namespaces of a cluster {name} are left from before: run down --name {name}")
        if slurm:
            slurm_mode.install()
        if ssh:
            ssh_mode.install()
        folder.mkdir(parents=True, exist_ok=True)
        for path in (folder.parent, folder):
            path.chmod(0o755)  # munged checks that its socket's folders are open to its clients
        state = ClusterState(name=name, dir=str(folder), subnet=subnet, prefix_len=prefix_len,
                             switch_netns=f"{netns_prefix(name)}switch", bridge=f"{name}-br", bandwidth=bandwidth,
                             latency_ms=latency_ms, loopback_hostname=loopback_hostname, scratch_path=scratch,
                             slurm=slurm, ssh=ssh)
        state.save()
        cluster = cls(state)
        try:
            cluster._build([f"{prefix}{i}" for i in range(hosts)], addresses)
        except BaseException as error:
            try:
                cluster.down()
            except ClusterError as leftover:
                raise ClusterError(f"up failed ({error}), and then {leftover}") from error
            if isinstance(error, (ClusterError, OSError)):
                raise ClusterError(f"up failed, everything it made is removed again: {error}") from error
            raise
        return cluster

    @classmethod
    def attach(cls, name: str = "vc") -> "VirtualCluster":
        return cls(ClusterState.load(check_name(name)))

    def _build(self, names: list[str], addresses: list[str]) -> None:
        state, folder = self.state, Path(self.state.dir)
        for sub in ("log", "etc-hosts"):
            (folder / sub).mkdir(exist_ok=True)
        self._add_netns(state.switch_netns)
        network.make_switch(state.switch_netns, state.bridge)
        for index, (name, address) in enumerate(zip(names, addresses)):
            host = Host(name=name, address=address, netns=f"{netns_prefix(state.name)}{name}",
                        link=f"{state.name}-s{index}", hosts_file=str(folder / "etc-hosts" / name))
            state.hosts.append(host)
            host.netns_inode = self._add_netns(host.netns)
            network.connect_host(state.switch_netns, state.bridge, host.link, host.netns, address, state.prefix_len)
            state.save()
            # Both ends of the link, so the host is shaped both ways; a packet between two hosts passes one
            # host's eth0 and the other's switch port, so each end adds half of the one-way latency.
            delay = state.latency_ms / 2 if state.latency_ms else None
            for netns, dev in ((host.netns, network.HOST_LINK), (state.switch_netns, host.link)):
                network.shape(netns, dev, state.bandwidth, delay)
            Path(host.hosts_file).write_text(
                host_setup.etc_hosts(names, addresses, name, state.loopback_hostname))
            self._start_keeper(host)
        if state.slurm:
            slurm_mode.start(self)
        if state.ssh:
            ssh_mode.start(self)
        state.ready = True
        state.save()

    def _add_netns(self, name: str) -> int:
        self.state.netns.append(name)  # recorded before it exists, so down removes it however up ends
        self.state.save()
        sh("ip", "netns", "add", name, what=f"making namespace {name}")
        inode = netns_inode(f"/run/netns/{name}")
        self.state.netns_inodes.append(inode)
        self.state.save()
        return inode

    def _start_keeper(self, host: Host) -> None:
        log = Path(self.state.dir) / "log" / f"keeper.{host.name}.log"
        process = host_setup.start_keeper(host.netns, log)
        self._children[process.pid] = process
        host.keeper = Proc.of(process.pid, "keeper", host.name, str(log))
        self.state.save()
        host_setup.wait_keeper(process, host.netns, log)
        host.keeper = Proc.of(process.pid, "keeper", host.name, str(log))  # its start time is final now
        self.state.save()
        scratch = None
        if self.state.scratch_path:
            folder = Path(self.state.dir) / "scratch" / host.name
            folder.mkdir(parents=True, exist_ok=True)
            # The mount point must exist in the shared root filesystem; it is left there at down
            # (an empty folder), since another cluster may have its hosts' scratch mounted on it.
            Path(self.state.scratch_path).mkdir(parents=True, exist_ok=True)
            host.scratch = str(folder)
            scratch = (folder, self.state.scratch_path)
        host_setup.configure(host.keeper, host.name, Path(host.hosts_file), scratch)

    def start_daemon(self, name: str, argv: list[str], host: str | None, env: dict | None = None) -> Proc:
        """A daemon in `host` (None: the root namespaces), recorded at once, its output in log/NAME[.HOST].out."""
        log = Path(self.state.dir) / "log" / (f"{name}.{host}.out" if host else f"{name}.out")
        prefix = host_setup.enter(self.host(host).keeper, cwd=self.state.dir) if host else []
        with open(log, "w") as out:
            process = subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        self._children[process.pid] = process
        proc = Proc.of(process.pid, name, host, str(log))
        self.state.daemons.append(proc)
        self.state.save()
        return proc

    # ---- what it is ----

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def dir(self) -> Path:
        return Path(self.state.dir)

    @property
    def hosts(self) -> list[str]:
        return [host.name for host in self.state.hosts]

    def host(self, host: str | int) -> Host:
        return self.state.host(host)

    def address(self, host: str | int) -> str:
        return self.host(host).address

    def netns_inodes(self) -> set[int]:
        """The cluster's network namespaces (to check afterwards that no process is left in one)."""
        return namespace_inodes(self.state)

    def keepers(self) -> list[Proc]:
        return [host.keeper for host in self.state.hosts if host.keeper]

    @property
    def slurm(self) -> "slurm_mode.SlurmView | None":
        return slurm_mode.SlurmView(self) if self.state.slurm else None

    @property
    def ssh_wrapper(self) -> Path | None:
        return ssh_mode.wrapper_path(self) if self.state.ssh else None

    # ---- using it ----

    def command(self, host: str | int, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """The full argv that runs `argv` inside `host` (in `cwd`, default the current folder)."""
        return host_setup.enter(self.host(host).keeper, str(cwd) if cwd else None) + [str(arg) for arg in argv]

    def run(self, host: str | int, argv: list[str], cwd=None, **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run inside `host`: same environment, stdin/stdout/stderr and exit code as CMD."""
        return subprocess.run(self.command(host, argv, cwd), **kwargs)

    def popen(self, host: str | int, argv: list[str], cwd=None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv, cwd), **kwargs)

    def cut(self, host: str | int) -> None:
        """The host's link goes down: its traffic to and from the others stops at once."""
        network.set_link(self.state.switch_netns, self.host(host).link, up=False)

    def heal(self, host: str | int) -> None:
        network.set_link(self.state.switch_netns, self.host(host).link, up=True)

    def is_cut(self, host: str | int) -> bool:
        return network.link_is_up(self.state.switch_netns, self.host(host).link) is False

    def wait_listening(self, host: str | int, port: int, timeout: float) -> bool:
        """Until something accepts TCP connections at the host's address and `port`, tried from inside it."""
        probe = ["timeout", "1", "bash", "-c", ': >"/dev/tcp/$0/$1"', self.address(host), str(port)]
        deadline = time.monotonic() + timeout
        while self.run(host, probe, stderr=subprocess.DEVNULL).returncode != 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def processes(self) -> list[Proc]:
        """Every live process inside the hosts (keepers, daemons, whatever was run there)."""
        return processes_inside(self.state)

    def down(self) -> list[str]:
        """Remove everything this cluster made; returns what was removed, one line each."""
        done = take_down(self.state, reap=set(self._children))
        for process in self._children.values():
            if process.returncode is None:
                process.poll()
        return done

    def __enter__(self) -> "VirtualCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def down_by_name(name: str) -> list[str]:
    """`down` for the CLI: from the state file, or, when it is gone, the namespaces named as the cluster's."""
    require_root_and_namespaces()
    check_name(name)
    try:
        state = ClusterState.load(name)
    except ClusterError:
        left = orphaned_namespaces(netns_prefix(name))
        if not left and not state_dir(name).exists():
            return []
        state = ClusterState(name=name, dir=str(state_dir(name)), subnet="", prefix_len=0, switch_netns="",
                             bridge="", netns=left)
    return take_down(state)
