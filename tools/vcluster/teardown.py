"""Taking a cluster apart: exactly what its state file records, by name and by PID, in any state.

Every step tolerates what is already gone, so `down` also finishes a failed `up`, an interrupted one,
or an earlier `down` that stopped half way. Processes are found by the network namespace they are in
(/proc/PID/ns/net), which catches everything started inside a host, whatever its name.
"""
import shutil
from pathlib import Path

from .procs import Proc, netns_inode, pids_in_netns, stop
from .state import STATE_ROOT, ClusterState
from .system import ClusterError, sh


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def namespace_inodes(state: ClusterState) -> set[int]:
    """The cluster's network namespaces as recorded, and as they are now (for one made after the record)."""
    inodes = set(state.netns_inodes)
    for name in state.netns:
        inode = netns_inode(f"/run/netns/{name}")
        if inode is not None:
            inodes.add(inode)
    return inodes


def processes_inside(state: ClusterState) -> list[Proc]:
    return [Proc.of(pid, _comm(pid)) for pid in pids_in_netns(namespace_inodes(state))]


def take_down(state: ClusterState, reap: set[int] = frozenset()) -> list[str]:
    """Remove everything `state` records; returns one line per thing removed. Raises a ClusterError,
    after doing all the rest, when a process would not die or a namespace could not be deleted."""
    done, stuck = [], []
    inside = processes_inside(state)
    stuck += stop(inside, reap=reap)
    if inside:
        done.append(f"stopped {len(inside)} processes inside the hosts")
    outside = [proc for proc in state.daemons if proc.host is None]
    stuck += stop(outside, reap=reap)
    done += [f"stopped {proc.name} (pid {proc.pid})" for proc in outside if proc not in stuck]
    failed = []
    for name in reversed(state.netns):
        if Path(f"/run/netns/{name}").exists():
            result = sh("ip", "netns", "delete", name, what=f"deleting namespace {name}", check=False)
            (failed if result.returncode else done).append(f"deleted namespace {name}")
    if Path(state.dir).is_dir() and not stuck and not failed:
        shutil.rmtree(state.dir, ignore_errors=True)
        done.append(f"removed {state.dir}")
    try:
        STATE_ROOT.rmdir()  # only when no other cluster is left in it
    except OSError:
        pass
    if stuck or failed:
        left = [f"{proc.name} (pid {proc.pid})" for proc in stuck] + failed
        raise ClusterError(f"down left behind {', '.join(left)}; state kept in {state.dir}")
    return done


def orphaned_namespaces(prefix: str) -> list[str]:
    """Namespaces named as this cluster's when its state file is gone (made by a `up` killed outright)."""
    result = sh("ip", "netns", "list", what="listing namespaces", check=False)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]
