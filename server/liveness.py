"""Liveness: every joined rank holds a Watch stream open; one that ends without a Leave means the rank is gone.

A process that dies (SIGKILL, an OOM kill, a crash) has its TCP connections
closed by its kernel at once, and gRPC ends the calls on them: the stream's end
is the aggregator's news, within milliseconds, that the rank will push no more.
A process that is stopped (SIGSTOP, a hung driver, a frozen VM) or a host
that vanishes from the network without closing its connections keeps its
stream open but falls silent: the client promises a heartbeat on its Watch
(``WatchRequest.heartbeat_ms``), and one late by more than the aggregator's
--keepalive-timeout loses the rank. A pause shorter than that loses nobody.
The heartbeats travel on a connection of their own, which carries no pushes
(gradq.client.shard_connections): an HTTP/2 ping's answer on a connection full
of pushes waits behind them, and on a slow link a healthy host's answer was
late by seconds (tests/reliability/test_slow_link_liveness.py). HTTP/2
keepalive still closes a connection silent for far longer
(``gradq.server.app``), which also watches a client that promises no
heartbeat. A rank that left (Leave) first, or a server that is stopping, ends
streams without losing anyone.

By default the rounds waiting on a lost rank fail at once for everyone, naming
it, and so do later rounds of that run (they could never complete), until the
rank rejoins or the job restarts as a new incarnation. Under a partial quorum
the rounds close over the ranks present instead. An elastic job drops the lost
member and goes on: its open rounds finish over the members left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gradq.server.errors import InvalidArgumentError, ResourceExhaustedError, RoundError, UnavailableError
from gradq.server.job import Job
from gradq.server.limits import ServiceLimits
from gradq.server.rounds import RoundTable

__all__ = ["HEARTBEAT_MS", "HEARTBEAT_RATE_FACTOR", "LOST_REASON", "Heartbeat", "Heartbeats", "Liveness", "MemberWatch"]

log = logging.getLogger(__name__)

LOST_REASON = "its Watch stream ended without a Leave: its process exited or its host became unreachable"
# The heartbeat periods a client may promise, in milliseconds: more often than every 50 ms is a flood, and a
# promise of more than 10 s watches nothing the connection's own keepalive would not.
HEARTBEAT_MS = (50, 10_000)
# A Watch may send its heartbeats up to this many times as often as it promised, on average. Each costs the
# loop the reading of a message (bench/watch_cost.py), so a client that sends them as fast as it can is a flood
# and its Watch is closed.
HEARTBEAT_RATE_FACTOR = 4


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
        late_after_s: how late a promised heartbeat may be before its rank is
            lost (--keepalive-timeout).
    """

    def __init__(self, table: RoundTable, limits: ServiceLimits, late_after_s: float) -> None:
        self._table = table
        self._limits = limits
        self.late_after_s = late_after_s
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

    def silence_limit(self, heartbeat_ms: int) -> float | None:
        """How long a Watch promising a heartbeat every ``heartbeat_ms`` may stay silent (None: it promised none).

        Raises:
            InvalidArgumentError: ``heartbeat_ms`` is outside ``HEARTBEAT_MS`` (and not 0).
        """
        if heartbeat_ms == 0:
            return None
        low, high = HEARTBEAT_MS
        if not low <= heartbeat_ms <= high:
            raise InvalidArgumentError(
                f"WatchRequest.heartbeat_ms={heartbeat_ms} is invalid; expected 0 (no heartbeat) or {low}..{high} "
                "milliseconds between the client's heartbeats"
            )
        return heartbeat_ms / 1000 + self.late_after_s

    def close(self, watch: MemberWatch, reason: str = LOST_REASON) -> None:
        """A Watch ended; unless its rank left first (or the server is stopping), the rank is lost for ``reason``."""
        jobs, job, rank = self._table.jobs, watch.job, watch.rank
        with jobs.lock:
            with self._lock:
                self._open -= 1
            job.watches -= 1
            if jobs.closing or job.retired or not job.members.lose(rank, reason, watch.tenure):
                return
            left = len(job.members.joined)
        log.warning("rank %d of %s is lost (%d members left): %s", rank, job.describe(), left, reason)
        self._table.member_gone(job, rank, f"rank {rank} was lost ({reason})", "rank_lost")


class Heartbeat:
    """When a Watch's client was last heard from, and whether it is late or flooding; touched on the loop only.

    Args:
        period_s: the heartbeat period the client promised.
        limit_s: how long the client may stay silent (``Liveness.silence_limit``).
        wake: set when it turns late or flooding (the Watch then ends, losing its rank).
        clock: a monotonic clock (``time.monotonic``), or a test's.
    """

    def __init__(self, period_s: float, limit_s: float, wake: asyncio.Event, clock: Callable[[], float]) -> None:
        self.limit_s, self._wake, self._clock = limit_s, wake, clock
        self.opened_at = self.heard_at = clock()
        self.late = False
        self.flooding = False
        # A token bucket: heartbeats refill it at HEARTBEAT_RATE_FACTOR times the promised rate. It holds what a
        # stall up to the silence limit can queue, twice over: a healthy client's backlog arrives in one burst.
        self._rate = HEARTBEAT_RATE_FACTOR / period_s
        self.burst = max(2 * limit_s / period_s, 2 * HEARTBEAT_RATE_FACTOR)
        self._allowance = self.burst
        self.heard = 0

    async def listen(self, requests: AsyncIterator[Any]) -> None:
        """Note every message on the stream (its content dropped unread) until the client half-closes it, or
        until it sends faster than its promise allows (``flooding``: the rest is not read)."""
        # A call that ends under it (cancelled, aborted) ends this too: the Watch's own end says why.
        with contextlib.suppress(Exception):
            async for request in requests:
                request.take()
                now = self._clock()
                self._allowance = min(self.burst, self._allowance + (now - self.heard_at) * self._rate) - 1
                self.heard_at, self.heard = now, self.heard + 1
                if self._allowance < 0:
                    self.flooding = True
                    self._wake.set()
                    return

    @property
    def broken_off(self) -> bool:
        """Whether the Watch must end: the client is late or flooding."""
        return self.late or self.flooding

    def broken(self, heartbeat_ms: int, late_after_s: float) -> RoundError | None:
        """Why the Watch ends now, naming the promise the client broke (None: it keeps it).

        ``heartbeat_ms`` is the client's promise, ``late_after_s`` --keepalive-timeout.
        """
        if self.late:
            return UnavailableError(
                f"it promised a heartbeat every {heartbeat_ms} ms on its Watch stream and sent none for "
                f"{self.silent_for():.1f} s (--keepalive-timeout={late_after_s:g}): its process is stopped or its "
                "host unreachable"
            )
        if self.flooding:
            return ResourceExhaustedError(
                f"it sent {self.heard} heartbeats on its Watch stream in {self.heard_at - self.opened_at:.1f} s, "
                f"more than {HEARTBEAT_RATE_FACTOR} times as often as the one every {heartbeat_ms} ms it promised "
                "(WatchRequest.heartbeat_ms): a flood"
            )
        return None

    def silent_for(self) -> float:
        """Seconds since the client was last heard."""
        return self._clock() - self.heard_at

    def check(self, now: float) -> None:
        """Turn ``late`` (and wake the Watch) if the client has been silent past its limit at ``now``."""
        if not self.late and now - self.heard_at > self.limit_s:
            self.late = True
            self._wake.set()


class Heartbeats:
    """Every Watch's heartbeat, checked together: one timer for the aggregator, none per stream.

    Args:
        period_s: how often they are checked (a late one is found at most this much later).
        clock: a monotonic clock (``time.monotonic``), or a test's.
    """

    def __init__(self, period_s: float, clock: Callable[[], float]) -> None:
        self.period_s, self._clock = period_s, clock
        self._beating: set[Heartbeat] = set()
        self._checking: asyncio.Task[None] | None = None

    def add(self, period_s: float, limit_s: float, wake: asyncio.Event) -> Heartbeat:
        """Watch a new stream's heartbeat (on the loop), checking from now on; ``wake`` is set when it turns late
        (or floods)."""
        heartbeat = Heartbeat(period_s, limit_s, wake, self._clock)
        self._beating.add(heartbeat)
        if self._checking is None or self._checking.done():
            self._checking = asyncio.get_running_loop().create_task(self._check_while_beating())
        return heartbeat

    def discard(self, heartbeat: Heartbeat) -> None:
        self._beating.discard(heartbeat)

    def check(self) -> None:
        """Flag every heartbeat late now."""
        now = self._clock()
        for heartbeat in self._beating:
            heartbeat.check(now)

    def stop(self) -> None:
        """Stop checking (the server is stopping; its Watch streams end without losing anyone)."""
        if self._checking is not None:
            self._checking.cancel()

    async def _check_while_beating(self) -> None:
        while self._beating:
            await asyncio.sleep(self.period_s)
            self.check()
