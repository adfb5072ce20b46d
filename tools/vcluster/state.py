"""What a cluster is made of, recorded in one JSON file in its state folder as it is made.

`up` records each namespace before making it and each process as soon as it starts, and saves
the file every time, so `down` can take apart exactly what exists, also after a failed or
interrupted `up`. Namespace and link names carry the cluster's name, so two clusters (and
anything else on the machine) never share one.
"""
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .options import ClusterOptions
from .procs import Proc
from .system import ClusterError

STATE_ROOT = Path(os.environ.get("VCLUSTER_STATE_ROOT", "/run/zero-lab-vcluster"))
NETNS_PREFIX = "zlvc-"


def netns_prefix(cluster: str) -> str:
    """Every network namespace of cluster `cluster` is named with this prefix, and nothing else is."""
    return f"{NETNS_PREFIX}{cluster}-"


def state_dir(cluster: str) -> Path:
    return STATE_ROOT / cluster


@dataclass
class Host:
    name: str
    address: str
    netns: str
    link: str                 # the switch-side end of the host's veth pair (its inside end is eth0)
    hosts_file: str
    scratch: str | None = None
    keeper: Proc | None = None


@dataclass
class ClusterState:
    name: str
    dir: str
    options: ClusterOptions | None  # as up was given them (None: a record rebuilt from namespace names)
    prefix_len: int
    switch_netns: str
    bridge: str
    hosts: list[Host] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)       # every namespace made (or about to be), in order
    daemons: list[Proc] = field(default_factory=list)
    ready: bool = False                                   # `up` finished

    @property
    def file(self) -> Path:
        return Path(self.dir) / "state.json"

    def save(self) -> None:
        """Write the whole record atomically, so a reader never sees half of it."""
        partial = self.file.with_suffix(".json.partial")
        partial.write_text(json.dumps(asdict(self), indent=1) + "\n")
        partial.replace(self.file)

    def host(self, name_or_index: str | int) -> Host:
        if isinstance(name_or_index, int) or str(name_or_index).isdigit():
            index = int(name_or_index)
            if 0 <= index < len(self.hosts):
                return self.hosts[index]
        for host in self.hosts:
            if host.name == name_or_index:
                return host
        names = ", ".join(host.name for host in self.hosts)
        raise ClusterError(f"cluster {self.name} has no host {name_or_index!r} (hosts: {names})")

    @classmethod
    def load(cls, cluster: str) -> "ClusterState":
        path = state_dir(cluster) / "state.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"no cluster named {cluster!r} is up (no {path})") from None
        except json.JSONDecodeError as error:
            raise ClusterError(f"{path} is not valid JSON: {error}") from None
        hosts = [Host(**{**host, "keeper": Proc(**host["keeper"]) if host.get("keeper") else None})
                 for host in raw.pop("hosts")]
        daemons = [Proc(**proc) for proc in raw.pop("daemons")]
        options = raw.pop("options")
        options = ClusterOptions(**options) if options else None
        return cls(**raw, options=options, hosts=hosts, daemons=daemons)
