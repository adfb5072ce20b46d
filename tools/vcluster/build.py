"""Bringing a cluster up: the switch, then each host (namespace, link, shaping, /etc/hosts, keeper),
then the daemons. Each namespace is recorded before it is made and each process as soon as it
starts, so whatever happens next, `down` finds it.
"""
from pathlib import Path

from . import hosts as host_setup
from . import network
from . import slurm as slurm_mode
from . import ssh as ssh_mode
from .procs import Proc
from .state import Host, netns_prefix
from .system import sh


def build(cluster) -> None:
    state, options = cluster.state, cluster.state.options
    for sub in ("log", "etc-hosts"):
        (cluster.dir / sub).mkdir(exist_ok=True)
    add_netns(cluster, state.switch_netns)
    network.make_switch(state.switch_netns, state.bridge)
    addresses, _ = network.host_addresses(options.subnet, options.hosts)
    for index, (name, address) in enumerate(zip(options.hostnames, addresses)):
        host = Host(name=name, address=address, netns=f"{netns_prefix(state.name)}{name}",
                    link=f"{state.name}-s{index}", hosts_file=str(cluster.dir / "etc-hosts" / name))
        state.hosts.append(host)
        add_netns(cluster, host.netns)
        network.connect_host(state.switch_netns, state.bridge, host.link, host.netns, address, state.prefix_len)
        state.save()
        # Both ends of the link, so the host is shaped both ways; a packet between two hosts passes one
        # host's eth0 and the other's switch port, so each end adds half of the one-way latency.
        delay = options.latency_ms / 2 if options.latency_ms else None
        for netns, dev in ((host.netns, network.HOST_LINK), (state.switch_netns, host.link)):
            network.shape(netns, dev, options.bandwidth, delay)
        Path(host.hosts_file).write_text(
            host_setup.etc_hosts(options.hostnames, addresses, name, options.loopback_hostname))
        start_keeper(cluster, host)
    if options.slurm:
        slurm_mode.start(cluster)
    if options.ssh:
        ssh_mode.start(cluster)
    state.ready = True
    state.save()


def add_netns(cluster, name: str) -> None:
    cluster.state.netns.append(name)  # recorded before it exists, so down removes it however up ends
    cluster.state.save()
    sh("ip", "netns", "add", name, what=f"making namespace {name}")


def start_keeper(cluster, host: Host) -> None:
    log = cluster.dir / "log" / f"keeper.{host.name}.log"
    process = host_setup.start_keeper(host.netns, log)
    cluster.adopt(process)
    host.keeper = Proc.of(process.pid, "keeper", host.name, str(log))
    cluster.state.save()
    host_setup.wait_keeper(process, host.netns, log)
    scratch = None
    mount_point = cluster.state.options.scratch
    if mount_point:
        folder = cluster.dir / "scratch" / host.name
        folder.mkdir(parents=True, exist_ok=True)
        # The mount point must exist in the shared root filesystem; it is left there at down
        # (an empty folder), since another cluster may have its hosts' scratch mounted on it.
        Path(mount_point).mkdir(parents=True, exist_ok=True)
        host.scratch = str(folder)
        cluster.state.save()
        scratch = (folder, mount_point)
    host_setup.configure(host.keeper, host.name, Path(host.hosts_file), scratch)
