"""Running system tools for the cluster: one-line errors, root checks, Debian installs.

Every failure a user can act on is a ClusterError whose message is one line naming what failed and
where; the CLI prints it as `error: ...` and exits 1.
"""
import os
import shutil
import subprocess
from pathlib import Path

# Daemons and admin tools live in sbin, which a non-login root shell may not have on PATH.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")


class ClusterError(RuntimeError):
    """Something the user can fix or must know; str(error) is the whole one-line message."""


def one_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of a tool's output, which is where tools put the reason."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][-limit:] if lines else "(no output)"


def tool(name: str) -> str:
    path = shutil.which(name, path=SEARCH_PATH)
    if path is None:
        raise ClusterError(f"`{name}` is not installed (looked in {SEARCH_PATH})")
    return path


def has_tool(name: str) -> bool:
    return shutil.which(name, path=SEARCH_PATH) is not None


def sh(*argv: str, what: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    """Run a short admin command (ip, tc, mount ...); on failure a ClusterError saying what was being done."""
    argv = (tool(argv[0]), *argv[1:])
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what}: `{' '.join(argv)}` did not finish within {timeout} s") from None
    if check and result.returncode != 0:
        raise ClusterError(f"{what}: {one_line(result.stderr or result.stdout)} (`{' '.join(argv)}`)")
    return result


def require_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError(f"virtual_cluster needs root to make and enter namespaces, links and mounts "
                           f"(running as uid {os.geteuid()})")


def require_root_and_namespaces() -> None:
    """Refuse early, with the reason, where the cluster cannot be made or taken apart."""
    require_root()
    for name in ("ip", "tc", "nsenter", "unshare", "mount"):
        tool(name)
    probe = subprocess.run([tool("unshare"), "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ClusterError(f"this machine does not permit new network, UTS and mount namespaces: "
                           f"{one_line(probe.stderr)}")


def apt_install(packages: tuple[str, ...], tools: tuple[str, ...]) -> None:
    """Install Debian packages when one of `tools` is missing, as root, without starting their services.

    apt would otherwise start munged, slurmd or sshd in the root namespace (listening on this machine's
    own addresses); a policy-rc.d that answers 101 ("not allowed") stops that. It is put in place only
    when none exists, and removed afterwards.
    """
    if all(has_tool(name) for name in tools):
        return
    if not has_tool("apt-get"):
        raise ClusterError(f"{', '.join(packages)} are not installed and there is no apt-get to install them")
    made_policy = not POLICY_RC_D.exists()
    if made_policy:
        POLICY_RC_D.write_text("#!/bin/sh\n# virtual_cluster: no service starts while it installs\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        for argv in (["apt-get", "update", "-qq"],
                     ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]):
            result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                raise ClusterError(f"`{' '.join(argv)}` failed: {one_line(result.stderr)}")
    finally:
        if made_policy:
            POLICY_RC_D.unlink(missing_ok=True)
    missing = [name for name in tools if not has_tool(name)]
    if missing:
        raise ClusterError(f"installed {' '.join(packages)} but {', '.join(missing)} are still missing")
