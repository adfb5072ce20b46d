"""Which network interface the ranks of this host use: the one that reaches the master, never whatever this
host's own name resolves to.

gloo (and NCCL's bootstrap) bind and advertise the address of an interface. Left alone, gloo resolves the
host's own name, and Debian and Ubuntu map that name to 127.0.1.1 in /etc/hosts: every rank then tells the
others to connect to 127.0.1.1, and a job over several hosts fails (`connectFullMesh failed ... Connection
refused`). Here the interface is the one the route to MASTER_ADDR leaves by (on the master host itself, the
one holding that address), and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are set to it unless the user set
them. When MASTER_ADDR is this host's own name resolved to a loopback address (that same Debian mapping, on
the master host) and the job spans several hosts, the interface is this host's non-loopback one: the one
of its default route, else the first that is up. A job on one host keeps loopback.

Finding the route sends nothing: a UDP socket's connect only asks the kernel which source address it would
use.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import MutableMapping

import psutil

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class InterfaceChoice:
    interface: str
    address: str  # this host's address on it
    master: str  # MASTER_ADDR as given
    master_address: str  # what it resolves to here
    why: str


def _ipv4(name: str) -> str:
    return socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _source_address(destination: str) -> str:
    """The source address the kernel picks for `destination` (a route lookup; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((destination, 9))
        return probe.getsockname()[0]


def _interfaces() -> dict[str, str]:
    """Interfaces that are up, by name, with their first IPv4 address."""
    stats = psutil.net_if_stats()
    found = {}
    for name, addresses in psutil.net_if_addrs().items():
        ipv4 = [a.address for a in addresses if a.family == socket.AF_INET]
        if ipv4 and name in stats and stats[name].isup:
            found[name] = ipv4[0]
    return found


def _default_route_interface() -> str | None:
    """The interface of the IPv4 default route, from /proc/net/route (None: no default route)."""
    try:
        with open("/proc/net/route") as handle:
            rows = [line.split() for line in handle.read().splitlines()[1:]]
    except OSError:
        return None
    return next((row[0] for row in rows if len(row) > 1 and row[1] == "00000000"), None)


def choose_interface(master: str, one_host: bool) -> InterfaceChoice:
    """one_host: every rank runs on this host (a master on loopback is then right)."""
    interfaces = _interfaces()
    master_address = _ipv4(master)
    if not _is_loopback(master_address):
        source = _source_address(master_address)
        name = next((name for name, address in interfaces.items() if address == source), None)
        if name is None:
            raise OSError(f"no interface of this host holds {source}, the address the route to {master} leaves from")
        return InterfaceChoice(name, source, master, master_address, f"the route to the master {master} "
                                                                     f"({master_address}) leaves by it")
    outward = {name: address for name, address in interfaces.items() if not _is_loopback(address)}
    if one_host or master in ("localhost", master_address) or not outward:
        name = next(name for name, address in interfaces.items() if _is_loopback(address))
        return InterfaceChoice(name, interfaces[name], master, master_address, "the master is this host, on loopback")
    default = _default_route_interface()
    name = default if default in outward else sorted(outward)[0]
    return InterfaceChoice(name, outward[name], master, master_address,
                           f"the master {master} is this host, but its name resolves to {master_address} here "
                           "(as Debian's /etc/hosts maps a host's own name): the ranks on other hosts reach it "
                           f"through {name}")


def configure(environ: MutableMapping[str, str], one_host: bool) -> tuple[str, str]:
    """Set the socket interface variables for MASTER_ADDR (unless the user set them). Returns the line that
    says, for this host, which interface and address its ranks use, and that address. one_host: every rank
    runs here."""
    host = socket.gethostname()
    given = {name: environ[name] for name in SOCKET_IFNAME_VARIABLES if environ.get(name)}
    if given:
        set_by_user = ", ".join(f"{name}={value}" for name, value in given.items())
        address = _interfaces().get(next(iter(given.values())), "")
        return f"[zero-lab] network on {host}: {set_by_user} (set by the user)", address
    choice = choose_interface(environ.get("MASTER_ADDR", "localhost"), one_host)
    for name in SOCKET_IFNAME_VARIABLES:
        environ[name] = choice.interface
    return (f"[zero-lab] network on {host}: the ranks use {choice.interface} ({choice.address}); {choice.why}",
            choice.address)
