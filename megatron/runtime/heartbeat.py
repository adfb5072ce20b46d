"""A host that falls silent ends the job within about a minute, however long collectives may wait.

A killed host's ranks close their connections, and the next collective fails at once (lost_peer.py).
A cut link closes nothing: a collective blocked on it waits out --distributed-timeout-minutes, which has
to be long enough for the slowest honest wait (rank 0 writing a large checkpoint while the others wait
at a barrier). The heartbeat tells a silent host from a busy one. Every rank's own thread adds 1 to its
counter in the job's rendezvous store (MASTER_ADDR:MASTER_PORT, on rank 0's host under every launcher)
each BEAT_SECONDS, whatever its main thread is doing:

- rank 0 reads every counter; ranks whose counters stood still for SILENT_SECONDS are lost;
- any other rank whose own beats have not reached the store for SILENT_SECONDS has lost rank 0.

Either says so in one line (lost_peer.Peers.lost) and ends its process with exit 1; the launcher then
ends the rest. A rank that finished marks itself done first, so a rank that is only slower to finish
is not taken for lost. (torchelastic's rendezvous keep-alive uses the same kind of beat: every 5 s.)
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from megatron.errors import ZeroLabError
from megatron.runtime.lost_peer import Peers

BEAT_SECONDS = 5.0
SILENT_SECONDS = 60.0
# SILENT_SECONDS for one run (docs/multi-node.md): e.g. the suite's cut-link test, which would otherwise wait out
# the minute; at least three beats, so that one late beat on a loaded host is not taken for a lost one
SILENT_SECONDS_VAR = "ZERO_LAB_HEARTBEAT_SECONDS"
# what a failed rank waits at most for its threads' store calls to return (milliseconds on a live store, seconds
# on a loaded machine) before its process exits
FAILED_JOIN_SECONDS = 5.0
_KEYS = "zero-lab/heartbeat"


def silent_seconds(environ=os.environ) -> float:
    """SILENT_SECONDS, or SILENT_SECONDS_VAR's seconds where it is set; another value is refused in one line."""
    value = environ.get(SILENT_SECONDS_VAR)
    if value is None:
        return SILENT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 3 * BEAT_SECONDS:  # nan too
        raise ZeroLabError(f"{SILENT_SECONDS_VAR}={value}: expected seconds >= {3 * BEAT_SECONDS:g} (three beats of "
                           f"{BEAT_SECONDS:g} s; default {SILENT_SECONDS:g})")
    return seconds


class Heartbeat:
    def __init__(self, peers: Peers, silent_seconds: float = SILENT_SECONDS, beat_seconds: float = BEAT_SECONDS):
        self.peers, self.silent_seconds, self.beat_seconds = peers, silent_seconds, beat_seconds
        self._stopping = threading.Event()
        self._store = None
        self._threads: list[threading.Thread] = []
        self._last_beat = time.monotonic()

    def start(self) -> "Heartbeat":
        """Starts beating (and, on rank 0, watching); a single-rank job has nobody to lose."""
        if len(self.peers.peers) == 1:
            return self
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=timedelta(seconds=self.silent_seconds))
        watchers = [self._watch_own_beats] if self.peers.rank != 0 else []  # rank 0 watches in _beat
        self._threads = [threading.Thread(target=target, name=f"zero-lab {target.__name__}", daemon=True)
                         for target in (self._beat, *watchers)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, finished: bool = True) -> None:
        """This rank stops beating and waits for its threads to end; one that `finished` also tells rank 0 no
        longer to wait for its beats. Called before the process exits, on every path: a daemon thread still
        inside a store call when Python shuts down is ended by pthread_exit, whose unwinding through torch's
        C++ frames aborts the rank ("terminate called without an active exception", SIGABRT)."""
        if self._store is None or self._stopping.is_set():
            return
        self._stopping.set()
        # a store call returns or fails within the store's timeout; a failed rank does not wait that long, but
        # long enough for a call to a live store to return (a beat at 0 s would leave it no time at all)
        for thread in self._threads:
            thread.join(timeout=self.silent_seconds if finished else max(self.beat_seconds, FAILED_JOIN_SECONDS))
        if not finished:
            return
        try:
            self._store.set(f"{_KEYS}/done/{self.peers.rank}", "1")
        except RuntimeError:
            pass  # the store's host finished first and took the store with it: nobody is left to watch

    def _beat(self) -> None:
        counts: dict[int, tuple[int, float]] = {}  # rank 0: rank -> (count, when it last moved)
        while not self._stopping.wait(self.beat_seconds):
            try:
                self._store.add(f"{_KEYS}/{self.peers.rank}", 1)
                self._last_beat = time.monotonic()
                if self.peers.rank == 0:
                    self._watch_the_others(counts)
            except RuntimeError:
                continue  # the store is unreachable: _watch_own_beats counts how long

    def _watch_the_others(self, counts: dict[int, tuple[int, float]]) -> None:
        now = time.monotonic()
        silent = []
        for peer in self.peers.peers[1:]:
            count = self._store.add(f"{_KEYS}/{peer.rank}", 0)
            last_count, since = counts.get(peer.rank, (None, now))
            counts[peer.rank] = (count, now if count != last_count else since)
            if now - counts[peer.rank][1] > self.silent_seconds:
                silent.append(peer)
        silent = [peer for peer in silent if not self._store.check([f"{_KEYS}/done/{peer.rank}"])]
        if silent and not self._stopping.is_set():
            self._end(silent)

    def _watch_own_beats(self) -> None:
        """Another rank than 0: its beats not reaching the store means rank 0's host is gone or cut off."""
        while not self._stopping.wait(self.beat_seconds):
            if time.monotonic() - self._last_beat > self.silent_seconds:
                self._end([self.peers.peers[0]])

    def _end(self, silent: list) -> None:
        how = f"no heartbeat for {self.silent_seconds:g} s: its host is down or cut off"
        print(f"error: {self.peers.lost(silent, how)}", file=sys.stderr, flush=True)
        os._exit(1)  # the main thread may be blocked in a collective that waits for the lost rank
