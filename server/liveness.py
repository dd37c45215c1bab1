"""Liveness: every joined rank holds a Watch stream open; one that ends without a Leave means the rank is gone.

A process that dies (SIGKILL, an OOM kill, a crash) has its TCP connections
closed by its kernel at once, and gRPC ends the calls on them: the stream's end
is the aggregator's news, within milliseconds, that the rank will push no more.
A rank that is only slow (a GC pause, a SIGSTOP) keeps its connection, so it is
not lost; a host that vanishes from the network without closing its
connections is found by the server's HTTP/2 keepalive (see
``gradq.server.app``). A rank that left (Leave) first, or a server that is
stopping, ends streams without losing anyone.

By default the rounds waiting on a lost rank fail at once for everyone, naming
it, and so do later rounds of that run (they could never complete), until the
rank rejoins or the job restarts as a new incarnation. Under a partial quorum
the rounds close over the ranks present instead. An elastic job drops the lost
member and goes on: its open rounds finish over the members left.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from gradq.server.errors import ResourceExhaustedError
from gradq.server.jobs import Job
from gradq.server.limits import ServiceLimits
from gradq.server.rounds import RoundTable

__all__ = ["LOST_REASON", "Liveness", "MemberWatch"]

log = logging.getLogger(__name__)

LOST_REASON = "its Watch stream ended without a Leave: its process exited or its host became unreachable"


@dataclass(eq=False, slots=True)
class MemberWatch:
    """One open Watch stream: which run and member it vouches for."""

    job: Job
    rank: int
    tenure: int  # the member's holder this stream vouches for (gradq.server.membership)


class Liveness:
    """Counts the Watch streams and turns one's unannounced end into a lost rank.

    Args:
        table: the jobs and rounds.
        limits: ``max_watches`` in all; a job may hold at most ``max_world_size``
            (one per rank, also when a host's ranks watch one member).
    """

    def __init__(self, table: RoundTable, limits: ServiceLimits) -> None:
        self._table = table
        self._limits = limits
        self._lock = threading.Lock()
        self._open = 0

    @property
    def open_watches(self) -> int:
        """Watch streams open now."""
        return self._open

    def open(self, job_id: str, rank: int, incarnation: str) -> MemberWatch:
        """A rank's Watch begins.

        Raises:
            FailedPreconditionError: the rank has not joined this run.
            ResourceExhaustedError: --max-watches streams are open, or the job holds one per rank already.
        """
        jobs = self._table.jobs
        with jobs.lock:
            job = jobs.member(job_id, rank, incarnation, self._table.now(), pending_ok=True)
            with self._lock:
                if self._open >= self._limits.max_watches:
                    raise ResourceExhaustedError(
                        f"{self._open} Watch streams are open, this aggregator's limit (--max-watches); "
                        f"rank {rank} of {job.describe()} trains on, its loss found at the round deadline instead"
                    )
                if job.watches >= self._limits.max_world_size:
                    raise ResourceExhaustedError(
                        f"{job.describe()} holds {job.watches} Watch streams, one per rank of the largest world "
                        f"(--max-world-size={self._limits.max_world_size}); close one first"
                    )
                self._open += 1
            job.watches += 1
        return MemberWatch(job, rank, job.members.tenure(rank))

    def close(self, watch: MemberWatch) -> None:
        """A Watch ended; unless its rank left first (or the server is stopping), the rank is lost."""
        jobs, job, rank = self._table.jobs, watch.job, watch.rank
        with jobs.lock:
            with self._lock:
                self._open -= 1
            job.watches -= 1
            if jobs.closing or job.retired or not job.members.lose(rank, LOST_REASON, watch.tenure):
                return
            left = len(job.members.joined)
        log.warning("rank %d of %s is lost (%d members left): %s", rank, job.describe(), left, LOST_REASON)
        self._table.member_gone(job, rank, f"rank {rank} was lost ({LOST_REASON})", "rank_lost")
