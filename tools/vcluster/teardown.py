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
    """The cluster's network namespaces that exist now, found by their names.

    Only by name: the inode of a namespace that is gone can be given to a new one of someone else's,
    whose processes must never be taken for ours. (A namespace stays named while processes are in it,
    since down deletes names only after every process inside has ended.)"""
    inodes = {netns_inode(f"/run/netns/{name}") for name in state.netns}
    return inodes - {None}


def processes_inside(state: ClusterState) -> list[Proc]:
    return [Proc.of(pid, _comm(pid)) for pid in pids_in_netns(namespace_inodes(state))]


def take_down(state: ClusterState, reap: set[int] = frozenset()) -> list[str]:
    """Remove everything `state` records; returns one line per thing removed. Raises a ClusterError,
    after doing all the rest, when a process would not die or a namespace could not be deleted."""
    done = []
    inside = processes_inside(state)
    outside = [proc for proc in state.daemons if proc.host is None and proc.alive()]
    stuck = stop(inside, reap=reap) + stop(outside, reap=reap)
    if stuck:  # keep the names and the record, so a later down finds them again
        left = ", ".join(f"{proc.name} (pid {proc.pid})" for proc in stuck)
        raise ClusterError(f"down could not end {left}; nothing else removed, state kept in {state.dir}")
    if inside:
        done.append(f"stopped {len(inside)} processes inside the hosts")
    done += [f"stopped {proc.name} (pid {proc.pid})" for proc in outside]
    failed = []
    for name in reversed(state.netns):
        if Path(f"/run/netns/{name}").exists():
            result = sh("ip", "netns", "delete", name, what=f"deleting namespace {name}", check=False)
            if result.returncode:
                failed.append(name)
            else:
                done.append(f"deleted namespace {name}")
    if failed:
        raise ClusterError(f"down could not delete {', '.join(failed)}; state kept in {state.dir}")
    if Path(state.dir).is_dir():
        shutil.rmtree(state.dir, ignore_errors=True)
        done.append(f"removed {state.dir}")
    try:
        STATE_ROOT.rmdir()  # only when no other cluster is left in it
    except OSError:
        pass
    return done


def orphaned_namespaces(prefix: str) -> list[str]:
    """Namespaces named as this cluster's when its state file is gone (made by a `up` killed outright)."""
    result = sh("ip", "netns", "list", what="listing namespaces", check=False)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]
