"""A cluster in a box: N hosts made of Linux network, UTS and mount namespaces (see tools/virtual_cluster.py).

    network   the switch namespace, veth links, addresses, tc shaping, cut and heal
    hosts     keeper processes, hostnames, /etc/hosts, entering a host with nsenter
    slurm     --slurm: munged, slurmctld and one slurmd per host, and SlurmView for the tests
    ssh       --ssh: one sshd per host, keys and the ssh wrapper for mpiexec
    state     the state file that records everything made
    procs     processes by PID and start time, or by network namespace
    teardown  down: remove exactly what the state file records
    cluster   VirtualCluster, which puts these together
"""
from .cluster import VirtualCluster, down_by_name
from .system import ClusterError

__all__ = ["VirtualCluster", "ClusterError", "down_by_name"]
