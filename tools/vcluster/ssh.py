"""--ssh: one sshd per host, with keys and configs of its own in the state folder.

Nothing in /root/.ssh or /etc/ssh is read or written: sshd gets `-f` our sshd_config (root may log
in with the cluster's key only, no PAM, no password), and clients go through the `ssh` wrapper in
the state folder, which runs `ssh -F ssh_config`. MPICH's Hydra uses that wrapper as its launcher:

    mpiexec -launcher ssh -launcher-exec STATE/ssh/ssh -hosts node0,node1 -n 2 hostname
"""
from pathlib import Path

from .system import ClusterError, apt_install, one_line, sh, tool

PACKAGES = ("openssh-server",)
TOOLS = ("sshd", "ssh", "ssh-keygen")
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without it; Debian's service unit makes it too

SSHD_CONFIG = """\
# virtual_cluster's sshd: one per host, each started with -o ListenAddress=<host address>
Port 22
HostKey {folder}/host_ed25519_key
AuthorizedKeysFile {folder}/authorized_keys
AllowUsers root
PermitRootLogin prohibit-password
AuthenticationMethods publickey
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
Subsystem sftp internal-sftp
"""

SSH_CONFIG = """\
# virtual_cluster's ssh client: the cluster's key, no host key checks (hosts come and go), quiet
Host *
  User root
  IdentityFile {folder}/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
  ConnectTimeout 10
"""


def install() -> None:
    apt_install(PACKAGES, TOOLS)


def folder_of(cluster) -> Path:
    return cluster.dir / "ssh"


def wrapper_path(cluster) -> Path:
    return folder_of(cluster) / "ssh"


def start(cluster) -> None:
    folder = folder_of(cluster)
    folder.mkdir(mode=0o700)  # sshd's StrictModes refuses keys in a folder others may write to
    for key in ("host_ed25519_key", "id_ed25519"):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"virtual_cluster {cluster.name}",
           "-f", str(folder / key), what=f"making ssh key {folder / key}")
    (folder / "authorized_keys").write_text((folder / "id_ed25519.pub").read_text())
    (folder / "authorized_keys").chmod(0o600)
    (folder / "sshd_config").write_text(SSHD_CONFIG.format(folder=folder))
    (folder / "ssh_config").write_text(SSH_CONFIG.format(folder=folder))
    wrapper = wrapper_path(cluster)
    wrapper.write_text(f'#!/bin/sh\n# ssh into cluster {cluster.name}\'s hosts\n'
                       f'exec {tool("ssh")} -F {folder / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    sshd = tool("sshd")  # sshd re-executes itself for each connection, so it needs its absolute path
    for host in cluster.state.hosts:
        log = cluster.dir / "log" / f"sshd.{host.name}.log"
        cluster.start_daemon("sshd", [sshd, "-D", "-f", str(folder / "sshd_config"), "-E", str(log),
                                      "-o", f"ListenAddress={host.address}",
                                      "-o", f"PidFile={folder / f'sshd.{host.name}.pid'}"], host.name)
    for host in cluster.state.hosts:
        if not cluster.wait_listening(host.name, 22, timeout=20):
            log = cluster.dir / "log" / f"sshd.{host.name}.log"
            raise ClusterError(f"sshd on {host.name} did not listen on {host.address}:22 within 20 s "
                               f"({log}: {one_line(log.read_text()) if log.exists() else 'no log'})")
