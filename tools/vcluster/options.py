"""What `up` is asked for, parsed once and checked in one place; each message names the flag."""
import re
from dataclasses import dataclass

from . import network
from .system import ClusterError

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,9}$")  # short enough for 15-character link names
HOSTNAME_PREFIX = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ClusterError(f"--name {name!r}: expected a lowercase letter then up to 9 letters or digits")
    return name


@dataclass
class ClusterOptions:
    hosts: int = 2
    name: str = "vc"
    prefix: str = "node"                 # hostnames are node0, node1, ...
    subnet: str = "10.250.0.0/24"
    bandwidth: str | None = None         # tc units: 200mbit, 1gbit
    latency_ms: float | None = None      # one-way, host to host
    loopback_hostname: bool = False
    scratch: str | None = None           # where each host's scratch folder is mounted; None: no scratch
    slurm: bool = False
    ssh: bool = False

    def __post_init__(self):
        check_name(self.name)
        if not HOSTNAME_PREFIX.match(self.prefix):
            raise ClusterError(f"--prefix {self.prefix!r}: expected a lowercase letter then letters, digits or '-'")
        if self.hosts < 1:
            raise ClusterError(f"--hosts {self.hosts}: expected at least 1")
        if self.bandwidth:
            network.parse_rate(self.bandwidth)
        if self.latency_ms is not None and self.latency_ms < 0:
            raise ClusterError(f"--latency {self.latency_ms}: expected milliseconds >= 0")
        if self.scratch is not None and not self.scratch.startswith("/"):
            raise ClusterError(f"--scratch-path {self.scratch!r}: expected an absolute path")
        network.host_addresses(self.subnet, self.hosts)

    @property
    def hostnames(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(self.hosts)]
