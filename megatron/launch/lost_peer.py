"""A collective that fails because another host is gone, said in one line naming that rank and host.

When a host's ranks are killed, the others' next collective fails at once ("Connection closed by peer
[10.250.0.2]:..."); when its link is cut, it waits, then times out after --distributed-timeout-minutes
("Timed out waiting 30000ms for recv operation to complete"). Either comes out of torch as a long
RuntimeError. `Peers` knows, from a gather right after the ranks met, which host and address each rank
has, so `Peers.describe` can name the ranks the failure points at: those at the address the message
names, else (a timeout names none) the ranks on the other hosts.
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass

import torch.distributed as dist

# What gloo and NCCL say when a peer is gone or silent.
_LOST = re.compile(r"gloo/transport|Connection (?:closed|reset) by peer|Timed out waiting|Broken pipe|NCCL")
_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?(?::\d+)?")


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    address: str


class Peers:
    def __init__(self, peers: list[Peer], rank: int):
        self.peers, self.rank = peers, rank

    @classmethod
    def gather(cls, address: str) -> "Peers":
        """Every rank's host and interface address (a collective, right after the ranks met)."""
        mine = (socket.gethostname(), address)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return cls([Peer(rank, host, addr) for rank, (host, addr) in enumerate(gathered)], dist.get_rank())

    @staticmethod
    def is_lost_peer(error: BaseException) -> bool:
        return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and bool(_LOST.search(str(error))))

    def _named(self, error: BaseException) -> list[Peer]:
        me = self.peers[self.rank]
        addresses = {match for match in _ADDRESS.findall(str(error)) if match != me.address}
        named = [peer for peer in self.peers if peer.address in addresses]
        return named or [peer for peer in self.peers if peer.host != me.host] or \
            [peer for peer in self.peers if peer.rank != self.rank]

    def describe(self, error: BaseException, timeout_minutes: float) -> str:
        """One line: which ranks (and hosts) a failed collective lost, and what to do."""
        if "Timed out" in str(error):
            how = f"no answer within --distributed-timeout-minutes {timeout_minutes:g}: its host is down or cut off"
        else:
            how = "its connection closed: its process or host is gone"
        return self.lost(self._named(error), how)

    def lost(self, named: list[Peer], how: str) -> str:
        hosts = sorted({peer.host for peer in named})
        ranks = ", ".join(str(peer.rank) for peer in named)
        where = ", ".join(f"{host} ({next(p.address for p in named if p.host == host)})" for host in hosts)
        plural = "s" if len(named) > 1 else ""
        return (f"lost rank{plural} {ranks} on {where}: {how}; the last checkpoint resumes on the hosts left "
                "with --universal-checkpoint (docs/multi-node.md)")
