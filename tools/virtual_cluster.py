"""A cluster in a box: N hosts made of Linux namespaces on this machine, to rehearse multi-node jobs.

    python tools/virtual_cluster.py up --hosts 2 [--bandwidth 200mbit] [--latency 5] [--slurm] [--ssh]
                                       [--loopback-hostname] [--scratch] [--subnet 10.250.0.0/24] [--name vc]
    python tools/virtual_cluster.py run node1 -- hostname      # any command, inside host node1
    python tools/virtual_cluster.py cut node1                  # node1's link goes down: silence
    python tools/virtual_cluster.py heal node1                 # and back up
    python tools/virtual_cluster.py status
    python tools/virtual_cluster.py down                       # removes everything `up` made

Each host has its own network namespace (address 10.250.0.<i+1> on eth0, joined to the others by a
bridge in a switch namespace, no route anywhere else), hostname (node0, node1, ...) and /etc/hosts;
the filesystem stays shared, as a cluster's shared filesystem is. `run` enters a host with nsenter,
keeping the current folder, the environment, stdin/stdout/stderr and the exit code.
--bandwidth shapes each host's link both ways with tc tbf, --latency adds a one-way delay between
two hosts (netem, half on each host's link), --loopback-hostname maps each host's own name to
127.0.1.1 as Debian installs do, --scratch mounts a per-host folder at /scratch (--scratch-path).
--slurm starts munged, slurmctld in node0 and a slurmd per host (run Slurm's commands inside node0:
`run node0 -- sinfo`, with SLURM_CONF from `status`); --ssh starts an sshd per host and writes an
`ssh` wrapper for `mpiexec -launcher ssh -launcher-exec WRAPPER`. Needs root. Everything is recorded
in /run/zero-lab-vcluster/NAME/state.json; `down` removes exactly that, also after a failed `up`.
Python: `from tools.vcluster import VirtualCluster` (docs/virtual-cluster.md).
"""
import argparse
import os
import signal
import sys

from vcluster import ClusterError, VirtualCluster, down_by_name
from vcluster import network
from vcluster.system import require_root
from vcluster.teardown import processes_inside


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="virtual_cluster.py", description=__doc__.split("\n")[0])
    # --name goes before or after the command; several clusters can be up at once under different names.
    name = argparse.ArgumentParser(add_help=False)
    name.add_argument("--name", default=argparse.SUPPRESS, help="cluster name (default vc)")
    parser.add_argument("--name", default="vc", help="cluster name (default vc)")
    sub = parser.add_subparsers(dest="command", required=True)
    add = lambda command, **kw: sub.add_parser(command, parents=[name], **kw)  # noqa: E731
    up = add("up", help="make the hosts (and daemons)")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--bandwidth", help="shape each link both ways, tc units: 200mbit, 1gbit")
    up.add_argument("--latency", type=float, metavar="MS", help="one-way delay between two hosts, milliseconds")
    up.add_argument("--subnet", default="10.250.0.0/24")
    up.add_argument("--prefix", default="node", help="hostnames are PREFIX0, PREFIX1, ...")
    up.add_argument("--loopback-hostname", action="store_true", help="own name -> 127.0.1.1 in /etc/hosts")
    up.add_argument("--scratch", action="store_true", help="a per-host folder mounted at --scratch-path")
    up.add_argument("--scratch-path", default="/scratch")
    up.add_argument("--slurm", action="store_true", help="munged, slurmctld on the first host, slurmd on each")
    up.add_argument("--ssh", action="store_true", help="sshd on each host and an ssh wrapper for mpiexec")
    run = add("run", help="run a command inside a host: run HOST -- CMD ...")
    run.add_argument("host")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    for command in ("cut", "heal"):
        add(command, help=f"{command} a host's link").add_argument("host")
    add("status", help="hosts, links, shaping, daemons")
    add("down", help="remove everything up made")
    args = parser.parse_args(argv)
    if args.command == "run":
        args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not args.cmd:
            parser.error("run: expected a command after the host, as in: run node0 -- hostname")
    return args


def print_up(cluster: VirtualCluster) -> None:
    for host in cluster.state.hosts:
        print(f"{host.name}\t{host.address}\t{cluster.dir}")
    me = f"python {sys.argv[0]}" + ("" if cluster.name == "vc" else f" --name {cluster.name}")
    print(f"run a command in a host:  {me} run {cluster.hosts[0]} -- CMD ...")
    print(f"see it, take it down:     {me} status;  {me} down")
    if cluster.slurm:
        print(f"slurm:                    export SLURM_CONF={cluster.slurm.conf}")
        print(f"  its clients run inside: {me} run {cluster.hosts[0]} -- sinfo")
    if cluster.ssh_wrapper:
        print(f"ssh (mpiexec's launcher): {me} run {cluster.hosts[0]} -- {cluster.ssh_wrapper} {cluster.hosts[-1]} "
              f"hostname")


def status_lines(cluster: VirtualCluster) -> list[str]:
    state = cluster.state
    lines = [f"cluster {state.name}: {len(state.hosts)} hosts on {state.options.subnet}, state in {state.dir}"
             + ("" if state.ready else " (up did not finish)")]
    for host in state.hosts:
        link = network.link_is_up(state.switch_netns, host.link)
        keeper = "keeper alive" if host.keeper and host.keeper.alive() else "keeper GONE"
        out, into = network.shaping(host.netns, network.HOST_LINK), network.shaping(state.switch_netns, host.link)
        shaping = f"{out} each way" if out == into else f"{out or 'unshaped'} out, {into or 'unshaped'} in"
        shaping = shaping if out or into else "unshaped"
        lines.append(f"  {host.name}\t{host.address}\tlink {({True: 'up', False: 'CUT', None: 'GONE'})[link]}"
                     f"\t{keeper}\t{shaping}")
    for proc in state.daemons:
        where = proc.host or "root namespace"
        lines.append(f"  daemon {proc.name} on {where}: pid {proc.pid} {'running' if proc.alive() else 'EXITED'}"
                     f" (log {proc.log})")
    lines.append(f"  {len(processes_inside(state))} processes inside the hosts")
    if cluster.slurm:
        lines.append(f"  SLURM_CONF={cluster.slurm.conf} (clients inside {cluster.hosts[0]})")
    if cluster.ssh_wrapper:
        lines.append(f"  ssh wrapper: {cluster.ssh_wrapper}")
    return lines


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    require_root()
    if args.command == "up":
        # A SIGTERM while `up` works is handled as Ctrl-C is: what was made is taken apart again.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            cluster = VirtualCluster.up(hosts=args.hosts, name=args.name, prefix=args.prefix, subnet=args.subnet,
                                        bandwidth=args.bandwidth, latency_ms=args.latency,
                                        loopback_hostname=args.loopback_hostname,
                                        scratch=args.scratch_path if args.scratch else None,
                                        slurm=args.slurm, ssh=args.ssh)
        except KeyboardInterrupt:
            raise ClusterError("up was interrupted; everything it made is removed again") from None
        print_up(cluster)
    elif args.command == "run":
        cluster = VirtualCluster.attach(args.name)
        argv = cluster.command(args.host, args.cmd)
        os.execv(argv[0], argv)  # the command's stdin/stdout/stderr, signals and exit code, as they are
    elif args.command in ("cut", "heal"):
        cluster = VirtualCluster.attach(args.name)
        getattr(cluster, args.command)(args.host)
        print(f"{cluster.host(args.host).name}: link {'cut' if args.command == 'cut' else 'up'}")
    elif args.command == "status":
        print("\n".join(status_lines(VirtualCluster.attach(args.name))))
    elif args.command == "down":
        done = down_by_name(args.name)
        print(f"cluster {args.name}: " + ("; ".join(done) if done else "nothing to take down"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
