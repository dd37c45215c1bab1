"""Caps on pushes waiting for their rounds (PushPull calls, pushes on streams), per job, per client host and in all.

A waiting PushPull holds no thread (it waits on the server's event loop),
but it does hold its coroutine and gRPC's call state until its round ends or
its client gives up. The caps keep one job or one host from taking all the
calls the server admits, and keep that memory bounded.
"""

from __future__ import annotations

import threading
from collections import Counter

from gradq.server.errors import ResourceExhaustedError

__all__ = ["WaitingCalls", "peer_host"]


def peer_host(peer: str) -> str:
    """The client host of a gRPC peer string (``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4``): one host, many ports."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class WaitingCalls:
    """Counts waiting calls and refuses one past a cap.

    Args:
        per_job: most waiting calls of one job (--max-waiting-per-job).
        per_peer: most waiting calls from one client host (--max-waiting-per-peer).
        total: most waiting calls in all (--max-waiting-calls).
    """

    def __init__(self, per_job: int, per_peer: int, total: int) -> None:
        self.per_job = per_job
        self.per_peer = per_peer
        self.total = total
        self._lock = threading.Lock()
        self._jobs: Counter[str] = Counter()
        self._peers: Counter[str] = Counter()
        self._count = 0

    @property
    def count(self) -> int:
        """Calls waiting now."""
        return self._count

    def acquire(self, job_id: str, peer: str) -> None:
        """Take a waiting slot; hand it back with ``release`` whatever happens.

        Raises:
            ResourceExhaustedError: naming the cap that is full (nothing is taken).
        """
        with self._lock:
            if self._count >= self.total:
                raise ResourceExhaustedError(
                    f"{self._count} pushes are waiting on this aggregator, its limit "
                    f"(--max-waiting-calls={self.total}); retry later"
                )
            if self._jobs[job_id] >= self.per_job:
                raise ResourceExhaustedError(
                    f"job {job_id[:64]!r} has {self._jobs[job_id]} pushes waiting, its limit "
                    f"(--max-waiting-per-job={self.per_job}); retry when its rounds finish"
                )
            if self._peers[peer] >= self.per_peer:
                raise ResourceExhaustedError(
                    f"client {peer} has {self._peers[peer]} pushes waiting, its limit "
                    f"(--max-waiting-per-peer={self.per_peer}); retry when its rounds finish"
                )
            self._count += 1
            self._jobs[job_id] += 1
            self._peers[peer] += 1

    def release(self, job_id: str, peer: str) -> None:
        """Give back a slot taken by ``acquire``."""
        with self._lock:
            self._count -= 1
            for counter, key in ((self._jobs, job_id), (self._peers, peer)):
                counter[key] -= 1
                if not counter[key]:
                    del counter[key]
