"""VirtualCluster: N hosts made of Linux namespaces on this machine, driven from Python.

    cluster = VirtualCluster.up(hosts=2, name="demo")          # the fields of ClusterOptions
    cluster.run("node1", ["hostname"], capture_output=True, text=True).stdout   # 'node1\\n'
    cluster.address("node1")                                                    # '10.250.0.2'
    cluster.cut("node1"); cluster.heal("node1")
    cluster.down()

`VirtualCluster.attach(name)` picks up a cluster that the CLI (or another process) brought up.
"""
import os
import subprocess
import time
from pathlib import Path

from . import hosts as host_setup
from . import network
from . import slurm as slurm_mode
from . import ssh as ssh_mode
from .build import build
from .options import ClusterOptions, check_name
from .procs import Proc, forks_of, netns_inode, pids_in_netns
from .state import ClusterState, Host, netns_prefix, state_dir
from .system import ClusterError, require_root_and_namespaces
from .teardown import namespace_inodes, orphaned_namespaces, processes_inside, take_down


class VirtualCluster:
    def __init__(self, state: ClusterState):
        self.state = state
        self._children: dict[int, subprocess.Popen] = {}  # started by this object: collected at down

    # ---- bringing one up, finding one ----

    @classmethod
    def up(cls, **options) -> "VirtualCluster":
        """Make the cluster; on any failure (or Ctrl-C) take apart what was made, then raise."""
        require_root_and_namespaces()
        options = ClusterOptions(**options)
        folder = state_dir(options.name)
        if (folder / "state.json").exists():
            raise ClusterError(f"cluster {options.name} is already up (state in {folder}): "
                               f"run down first, or pick another --name")
        if orphaned_namespaces(netns_prefix(options.name)):
            raise ClusterError(f"namespaces of a cluster {options.name} are left from before: "
                               f"run down --name {options.name}")
        if options.slurm:
            slurm_mode.install()
        if options.ssh:
            ssh_mode.install()
        folder.mkdir(parents=True, exist_ok=True)
        for path in (folder.parent, folder):
            path.chmod(0o755)  # munged checks that its socket's folders are open to its clients
        _, prefix_len = network.host_addresses(options.subnet, options.hosts)
        state = ClusterState(name=options.name, dir=str(folder), options=options, prefix_len=prefix_len,
                             switch_netns=f"{netns_prefix(options.name)}switch", bridge=f"{options.name}-br")
        state.save()
        cluster = cls(state)
        try:
            build(cluster)
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

    def adopt(self, process: subprocess.Popen) -> None:
        """A process started for the cluster by this object, so down collects its exit (no zombie left)."""
        self._children[process.pid] = process

    def start_daemon(self, name: str, argv: list[str], host: str | None, env: dict | None = None) -> Proc:
        """A daemon in `host` (None: the root namespaces), recorded at once, its output in log/NAME[.HOST].out."""
        log = self.dir / "log" / (f"{name}.{host}.out" if host else f"{name}.out")
        prefix = host_setup.enter(self.host(host).keeper, cwd=self.state.dir) if host else []
        with open(log, "w") as out:
            process = subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        self.adopt(process)
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
    def options(self) -> ClusterOptions:
        return self.state.options

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

    def processes(self) -> list[Proc]:
        """Every live process inside the hosts (keepers, daemons, whatever was run there)."""
        return processes_inside(self.state)

    def pids_in(self, host: str | int) -> list[int]:
        """Every live process inside `host` but its keeper, the cluster's daemons and their forks: what was run
        there."""
        inode = netns_inode(f"/run/netns/{self.host(host).netns}")
        own = {proc.pid for proc in [*self.keepers(), *self.state.daemons]}
        inside = pids_in_netns({inode} - {None})
        own |= forks_of(own, inside)  # the daemons' own helpers (slurmctld's slurmscriptd)
        return [pid for pid in inside if pid not in own]

    @property
    def slurm(self) -> "slurm_mode.SlurmView | None":
        return slurm_mode.SlurmView(self) if self.options.slurm else None

    @property
    def ssh_wrapper(self) -> Path | None:
        return ssh_mode.wrapper_path(self) if self.options.ssh else None

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

    def down(self) -> list[str]:
        """Remove everything this cluster made; returns what was removed, one line each."""
        done = take_down(self.state, reap=set(self._children))
        for process in self._children.values():
            process.poll()  # collects the exit of a child that ended after take_down looked
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
        state = ClusterState(name=name, dir=str(state_dir(name)), options=None, prefix_len=0, switch_netns="",
                             bridge="", netns=left)
    return take_down(state)
