"""A collective that fails because another host is gone, said in one line naming that rank and host.

When a host's ranks are killed, the others' next collective fails at once ("Connection closed by peer
[10.250.0.2]:..."); when its link is cut, it waits, then times out after --distributed-timeout-minutes
("Timed out waiting 30000ms for recv operation to complete"). Either comes out of torch as a long
RuntimeError. `Peers` knows, from a gather right after the ranks met, which host and address each rank
has, so `Peers.describe` can name the ranks the failure points at: those at the address the message
names, else (a timeout names none) the ranks on the other hosts.

Only a closed or reset connection and a timeout say a peer is lost. Every other failure of a collective (an
NCCL error from a full /dev/shm, a misuse such as two ranks on one GPU, an InfiniBand device that does not
open) is this host's own, and goes up with its own message; and a lost peer's line ends with the first line
of what torch said, so that a misreading can still be seen.
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass

import torch.distributed as dist

# What gloo and NCCL say when a peer is gone or silent: gloo's "Connection closed by peer [addr]:port" and
# "Timed out waiting 30000ms for recv operation", NCCL's "Connection closed by remote peer", "Connection reset
# by peer", ncclRemoteError ("remote process exited or there was a network error") and its watchdog's
# "... ran for 600000 milliseconds before timing out". Searched in the whole message: NCCL puts the socket's
# words under "Last error:".
_CLOSED = re.compile(r"Connection (?:closed|reset) by (?:remote )?peer|Broken pipe|remote process exited|"
                     r"ncclRemoteError")
# (Not every "timed out": CUDA's "the launch timed out and was terminated" is this host's own.)
_TIMEOUT = re.compile(r"Timed out waiting|milliseconds before timing out|wait timeout after \d+ ?ms")
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
        """Whether a collective's error says a peer closed its connection or did not answer in time."""
        text = str(error)
        return isinstance(error, RuntimeError) and bool(_CLOSED.search(text) or _TIMEOUT.search(text))

    def _named(self, error: BaseException) -> list[Peer]:
        me = self.peers[self.rank]
        addresses = {match for match in _ADDRESS.findall(str(error)) if match != me.address}
        named = [peer for peer in self.peers if peer.address in addresses]
        return named or [peer for peer in self.peers if peer.host != me.host] or \
            [peer for peer in self.peers if peer.rank != self.rank]

    def describe(self, error: BaseException, timeout_minutes: float) -> str:
        """One line: which ranks (and hosts) a failed collective lost, and what to do."""
        if _TIMEOUT.search(str(error)) and not _CLOSED.search(str(error)):
            how = f"no answer within --distributed-timeout-minutes {timeout_minutes:g}: its host is down or cut off"
        else:
            how = "its connection closed: its process or host is gone"
        return self.lost(self._named(error), how, said=first_line(error))

    def lost(self, named: list[Peer], how: str, said: str = "") -> str:
        hosts = sorted({peer.host for peer in named})
        ranks = ", ".join(str(peer.rank) for peer in named)
        where = ", ".join(f"{host} ({next(p.address for p in named if p.host == host)})" for host in hosts)
        plural = "s" if len(named) > 1 else ""
        told = f"; torch said: {said}" if said else ""
        return (f"lost rank{plural} {ranks} on {where}: {how}; the last checkpoint resumes on the hosts left "
                f"with --universal-checkpoint (docs/multi-node.md){told}")


def first_line(error: BaseException) -> str:
    """The error's first line, and NCCL's "Last error:" line after it when there is one (NCCL's first line
    names only the error class: "NCCL error in: ...: remote process exited or there was a network error")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    after = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line == "Last error:"]
    return f"{lines[0]} (last error: {after[0]})" if after else lines[0]
