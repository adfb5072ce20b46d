"""A host: a long-lived "keeper" process holding its own UTS and mount namespaces inside the host's
network namespace, its hostname, and its /etc/hosts (a file of the state folder bind-mounted there).

Commands enter a host with `nsenter -t KEEPER --net --uts --mount`, which keeps /sys as it is
(`ip netns exec` remounts it, and slurmd's cgroup set-up needs the real one). The mount namespace
is a copy of the root one, made its slave: the repo, the venv and /tmp stay shared, only what is
bind-mounted per host differs, and where the root mount is shared (as systemd makes it) mounts made
outside later appear inside too.
"""
import os
import subprocess
import time
from pathlib import Path

from .procs import Proc
from .system import ClusterError, sh, tool

LOOPBACK_HOSTNAME_ADDRESS = "127.0.1.1"  # where Debian and Ubuntu installs map the machine's own name


def etc_hosts(names: list[str], addresses: list[str], own: str, loopback_hostname: bool) -> str:
    """The /etc/hosts of host `own`: localhost, then every host; with `loopback_hostname` the own name
    maps to 127.0.1.1 only, as a stock Debian install writes it (the case distributed training trips on)."""
    lines = ["127.0.0.1\tlocalhost"]
    if loopback_hostname:
        lines.append(f"{LOOPBACK_HOSTNAME_ADDRESS}\t{own}")
    lines += [f"{address}\t{name}" for name, address in zip(names, addresses)
              if not (loopback_hostname and name == own)]
    lines += ["", "::1\tlocalhost ip6-localhost ip6-loopback", "ff02::1\tip6-allnodes", "ff02::2\tip6-allrouters"]
    return "\n".join(lines) + "\n"


def start_keeper(netns: str, log: Path) -> subprocess.Popen:
    """`sleep infinity` in the network namespace `netns` and new UTS and mount namespaces of its own.

    nsenter and unshare exec into it, so the returned process is the keeper itself. Its own session
    keeps it alive after the `up` that started it exits."""
    argv = [tool("nsenter"), f"--net=/run/netns/{netns}", "--", tool("unshare"), "--uts", "--mount",
            "--propagation", "slave", "--", tool("sleep"), "infinity"]
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_keeper(process: subprocess.Popen, netns: str, log: Path, timeout: float = 10) -> None:
    """Until the keeper is `sleep` in its own mount namespace (before that, entering it would enter ours)."""
    ours = os.stat("/proc/self/ns/mnt").st_ino
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ClusterError(f"the keeper of {netns} exited with {process.returncode}: {log.read_text().strip()}")
        try:
            ready = (Path(f"/proc/{process.pid}/comm").read_text().strip() == "sleep"
                     and os.stat(f"/proc/{process.pid}/ns/mnt").st_ino != ours)
        except OSError:
            ready = False
        if ready:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"the keeper of {netns} was not ready within {timeout} s")
        time.sleep(0.01)


def enter(keeper: Proc, cwd: str | None = None) -> list[str]:
    """The argv prefix that runs a command inside the keeper's host, in `cwd` (default: ours)."""
    if not keeper.alive():
        raise ClusterError(f"host {keeper.host}'s keeper (pid {keeper.pid}) is gone: run down, then up again")
    return [tool("nsenter"), "-t", str(keeper.pid), "--net", "--uts", "--mount", f"--wd={cwd or os.getcwd()}", "--"]


def configure(keeper: Proc, hostname: str, hosts_file: Path, scratch: tuple[Path, str] | None) -> None:
    """Hostname, /etc/hosts and the optional scratch folder, set from outside through nsenter."""
    base = [tool("nsenter"), "-t", str(keeper.pid)]
    sh(*base, "--uts", tool("hostname"), hostname, what=f"setting hostname {hostname}")
    sh(*base, "--mount", tool("mount"), "--bind", str(hosts_file), "/etc/hosts",
       what=f"mounting {hosts_file} on /etc/hosts of {hostname}")
    if scratch:
        folder, mount_point = scratch
        sh(*base, "--mount", tool("mount"), "--bind", str(folder), mount_point,
           what=f"mounting {folder} on {mount_point} of {hostname}")
