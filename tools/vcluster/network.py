"""The cluster's network: a bridge in a "switch" namespace, one veth pair per host, tc shaping.

Nothing is added to the root namespace: each veth pair is made inside the switch namespace with its
other end created directly in the host's namespace, where it is called eth0 (the same name on every
host, as on real nodes, so GLOO_SOCKET_IFNAME=eth0 works everywhere). Hosts get an address on the
cluster's subnet and no default route, so they reach each other and nothing else.
"""
import ipaddress
import json
import re

from .system import ClusterError, sh

HOST_LINK = "eth0"
RATE_PATTERN = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(rate: str) -> float:
    """'200mbit' -> 2e8 bits per second (tc's own unit names; 'mbps' would be megabytes to tc, so it is refused)."""
    match = RATE_PATTERN.match(rate.strip().lower())
    if not match:
        raise ClusterError(f"--bandwidth {rate!r}: expected a number and bit, kbit, mbit or gbit (e.g. 200mbit)")
    bits = float(match.group(1)) * RATE_UNITS[match.group(2)]
    if bits < 8000:
        raise ClusterError(f"--bandwidth {rate!r}: below 8kbit no TCP connection works")
    return bits


def host_addresses(subnet: str, count: int) -> tuple[list[str], int]:
    """Host i gets the subnet's (i+1)-th address; returns the addresses and the prefix length."""
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as error:
        raise ClusterError(f"--subnet {subnet!r}: {error}") from None
    if network.version != 4 or not network.is_private:
        raise ClusterError(f"--subnet {subnet}: expected a private IPv4 network such as 10.250.0.0/24")
    if count > network.num_addresses - 2:
        raise ClusterError(f"--subnet {subnet} has room for {network.num_addresses - 2} hosts, not {count}")
    return [str(network.network_address + i + 1) for i in range(count)], network.prefixlen


def make_switch(netns: str, bridge: str) -> None:
    sh("ip", "-n", netns, "link", "add", bridge, "type", "bridge", what=f"making bridge {bridge} in {netns}")
    sh("ip", "-n", netns, "link", "set", bridge, "up", what=f"bringing bridge {bridge} up")


def connect_host(switch_netns: str, bridge: str, link: str, host_netns: str, address: str, prefix_len: int) -> None:
    """The host's veth pair: `link` on the bridge, eth0 inside the host with its address; lo up too."""
    what = f"linking {host_netns} to the switch"
    sh("ip", "-n", host_netns, "link", "set", "lo", "up", what=f"bringing lo up in {host_netns}")
    sh("ip", "-n", switch_netns, "link", "add", link, "type", "veth", "peer", "name", HOST_LINK,
       "netns", host_netns, what=what)
    sh("ip", "-n", switch_netns, "link", "set", link, "master", bridge, "up", what=what)
    sh("ip", "-n", host_netns, "addr", "add", f"{address}/{prefix_len}", "dev", HOST_LINK, what=what)
    sh("ip", "-n", host_netns, "link", "set", HOST_LINK, "up", what=what)


def burst_bytes(bits_per_s: float) -> int:
    """tbf's bucket: 5 ms at the full rate, and at least two 64 KiB segments, so the kernel's large
    TCP segments pass whole instead of being split (which costs CPU and rate)."""
    return max(int(bits_per_s / 8 * 0.005), 2 * 65536)


def shape(netns: str, dev: str, bandwidth: str | None, delay_ms: float | None) -> None:
    """Egress shaping of one end of a link: netem holding each packet `delay_ms`, then tbf at `bandwidth`
    (netem at the root and tbf under it, the order netem's documentation gives for the pair)."""
    what = f"shaping {dev} in {netns}"
    tbf = ["tbf", "rate", bandwidth, "burst", str(burst_bytes(parse_rate(bandwidth))), "latency", "50ms"] \
        if bandwidth else []
    if delay_ms:
        # limit: room for a full window at 1gbit and the delay; netem's default of 1000 packets is less
        result = sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                    f"{delay_ms}ms", "limit", "100000", what=what, check=False)
        if result.returncode != 0:
            reason = result.stderr.strip() or "tc failed"
            if "unknown" in reason.lower():
                reason = "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so --latency is unavailable"
            raise ClusterError(f"{what}: {reason}")
        if tbf:
            sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf, what=what)
    elif tbf:
        sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf, what=what)


def set_link(switch_netns: str, link: str, up: bool) -> None:
    """Cut or heal a host: its switch port goes down, so the host sees silence (no carrier), not an error."""
    sh("ip", "-n", switch_netns, "link", "set", link, "up" if up else "down",
       what=f"setting switch port {link} {'up' if up else 'down'}")


def link_is_up(switch_netns: str, link: str) -> bool | None:
    """True: up; False: cut; None: the link (or the switch) is gone."""
    result = sh("ip", "-j", "-n", switch_netns, "link", "show", link, what="reading link state", check=False)
    if result.returncode != 0:
        return None
    return "UP" in json.loads(result.stdout)[0].get("flags", [])


def shaping(netns: str, dev: str) -> str:
    """One link end's shaping in words ('' when none, or gone), e.g. 'delay 2.5ms, 200mbit'."""
    result = sh("tc", "-j", "-n", netns, "qdisc", "show", "dev", dev, what="reading shaping", check=False)
    words = []
    for qdisc in json.loads(result.stdout or "[]"):
        options = qdisc.get("options", {})
        if qdisc["kind"] == "netem":
            delay = options.get("delay", 0)
            delay = delay.get("delay", 0) if isinstance(delay, dict) else delay  # seconds
            words.append(f"delay {float(delay) * 1e3:g}ms")
        elif qdisc["kind"] == "tbf":
            words.append(f"{options['rate'] * 8 / 1e6:g}mbit")  # tc reports bytes per second
    return ", ".join(words)
