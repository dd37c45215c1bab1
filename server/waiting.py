"""Caps on pushes waiting for their rounds (PushPull calls, pushes on streams), per job, per client host and in all;
and on the push streams one client host holds open.

A waiting PushPull holds no thread (it waits on the server's event loop),
but it does hold its coroutine and gRPC's call state until its round ends or
its client gives up. The caps keep one job or one host from taking all the
calls the server admits, and keep that memory bounded.

A client may open several connections to a shard (a long path fills one
connection's send buffer), each with its push stream; every stream may hold
requests not yet in their rounds. So the streams are counted per client host,
whatever connection they came on, and one past ``streams_per_peer`` is refused.
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
        streams_per_peer: most PushPullStream calls open at once from one client host (--max-streams-per-peer).
    """

    def __init__(self, per_job: int, per_peer: int, total: int, streams_per_peer: int = 128) -> None:
        self.per_job = per_job
        self.per_peer = per_peer
        self.total = total
        self.streams_per_peer = streams_per_peer
        self._streams: Counter[str] = Counter()
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

    def open_stream(self, peer: str) -> None:
        """Count a push stream of ``peer`` (a client host); hand it back with ``close_stream``.

        Raises:
            ResourceExhaustedError: naming the cap, when ``peer`` holds as many open already (nothing is taken).
        """
        with self._lock:
            if self._streams[peer] >= self.streams_per_peer:
                raise ResourceExhaustedError(
                    f"client {peer} has {self._streams[peer]} push streams open, its limit "
                    f"(--max-streams-per-peer={self.streams_per_peer}), counted over all its connections; "
                    f"retry when one ends"
                )
            self._streams[peer] += 1

    def close_stream(self, peer: str) -> None:
        """Give back a stream counted by ``open_stream``."""
        with self._lock:
            self._streams[peer] -= 1
            if not self._streams[peer]:
                del self._streams[peer]

    def streams(self, peer: str) -> int:
        """Push streams ``peer`` holds open now."""
        with self._lock:
            return self._streams[peer]
