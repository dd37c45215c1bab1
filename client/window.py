"""ShardWindow: the pushes per shard on the wire at once, bounded by bytes sized to the path, the rest waiting in order.

gRPC multiplexes every call to a shard over one HTTP/2 connection, so a step's
chunks, sent all at once, share the shard's inbound link and arrive together
at the end; only then do their means go out. With two in flight, one chunk
arrives while the mean of the one before leaves, so a shard's inbound and
outbound links work at the same time: at 100 Mbit/s, world 4, two shards and
2^17-element chunks the 8-bit step went from 1439 to 1064 ms (its link needs
951 ms; bench/network.py).

Two pushes is right for a LAN and starves a long path: two chunks of 1 MiB
per round trip carry 20 MB/s at 100 ms whatever the link. So the count is
only a floor: past it a push is admitted while the bytes in flight fit twice
the path's bandwidth-delay product, measured from what the client already
sees (``PathEstimate``): the shortest round trip of a push, and the bytes
answered per second while a push was out. A window that is the whole product
gets the rate it measured; twice it leaves room to find a faster rate, so the
window doubles each round trip until the link, not the window, sets the rate
(TCP's slow start, counted in pushes). On a LAN the product is a fraction of
one push and the window stays at its count.

A waiting push starts only when one of the same shard settles, so every rank
must push in the same order (DDP's hook does): two ranks each holding the
other's next rounds behind their own would wait until the round deadline.
With bytes the windows of two ranks may differ, but each admits a prefix of
the same order, so the rounds both have sent always complete.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_WINDOW_BYTES",
    "DEFAULT_MAX_WINDOW_PUSHES",
    "PathEstimate",
    "ShardWindow",
    "WindowSettings",
    "check_max_in_flight",
    "connection_send_buffer",
]

T = TypeVar("T")

# The most request bytes one shard's window holds: they stay in memory until answered, for a resend.
# 256 MiB covers twice the product of 10 Gbit/s at 100 ms.
DEFAULT_MAX_WINDOW_BYTES = 256 << 20
# The most pushes one shard's window holds, whatever their size: the aggregator refuses a job's rounds
# past --max-open-rounds (256 by default), and every push in flight may open one.
DEFAULT_MAX_WINDOW_PUSHES = 64
# The most connections to one shard. Linux caps one connection's send buffer at tcp_wmem[2] (4 MiB by
# default): about 40 MB/s at 100 ms. Eight carry 320 MB/s, past a 1 Gbit/s link between regions.
DEFAULT_MAX_CONNECTIONS = 8
# The shortest round trip is measured afresh this often (see PathEstimate).
_FILTER_S = 10.0
# Rates are remembered for this many shortest round trips, and at least this long: a link that slowed
# is followed within them (BBR keeps 10 round trips). The last rate outlives any idle spell.
_RATE_ROUNDS = 10
_MIN_RATE_FILTER_S = 0.5
# When the latest _RECENT answers all came later than this many times the shortest round trip, a queue
# stands on the path (the window is past it): the window then holds one product, not two, until it drains.
_QUEUE_FACTOR = 2.5
_RECENT = 8
# Where /proc does not say: Linux's default tcp_wmem[2].
_DEFAULT_SEND_BUFFER = 4 << 20


def check_max_in_flight(limit: int | None) -> None:
    """Raise ValueError unless ``limit`` is an integer >= 1 or None."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"max_in_flight={limit!r} is invalid; expected an integer >= 1, or None for no limit")


def connection_send_buffer() -> int:
    """The most bytes one TCP connection of this host keeps unacknowledged: tcp_wmem's maximum (4 MiB if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem", encoding="ascii") as settings:
            return max(int(settings.read().split()[2]), 64 << 10)
    except (OSError, ValueError, IndexError):
        return _DEFAULT_SEND_BUFFER


@dataclass(frozen=True, slots=True)
class WindowSettings:
    """How a shard's window grows past its count of pushes.

    Args:
        sized_to_path: grow past the count to twice the measured bandwidth-delay
            product; False keeps the count alone (the LAN setting before windows
            were sized in bytes).
        max_bytes: the most request bytes in flight per shard (memory held for resends).
        max_pushes: the most pushes in flight per shard.
        max_connections: the most connections per shard; 1 never opens another.
        connection_bytes: what one connection carries per round trip (its send buffer).
        path_estimate: makes what measures each shard's path (tests inject one
            with a clock or round trips of their own).
    """

    sized_to_path: bool = True
    max_bytes: int = DEFAULT_MAX_WINDOW_BYTES
    max_pushes: int = DEFAULT_MAX_WINDOW_PUSHES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    connection_bytes: int = -1  # -1: connection_send_buffer()
    path_estimate: Callable[[], PathEstimate] = field(default_factory=lambda: PathEstimate)

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pushes", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; expected an integer >= 1")
        if self.connection_bytes == -1:
            object.__setattr__(self, "connection_bytes", connection_send_buffer())
        if isinstance(self.connection_bytes, bool) or not isinstance(self.connection_bytes, int):
            raise ValueError(f"connection_bytes={self.connection_bytes!r} is invalid; expected an integer >= 1")
        if self.connection_bytes < 1:
            raise ValueError(f"connection_bytes={self.connection_bytes} is invalid; expected >= 1 (or -1: tcp_wmem)")


class PathEstimate:
    """One shard's path as its pushes see it: the shortest round trip and the fastest delivery, recently.

    Pure bookkeeping with an injected clock (no I/O, not thread-safe: the
    window calls it under its lock). A push's round trip runs from its send
    to its answer, so it includes the wait for the other ranks' pushes: the
    minimum leaves those waits out. A rate sample is the bytes answered while
    the push was out over its round trip (BBR's delivery rate), the fastest of
    the last ``_RATE_ROUNDS`` round trips counting: idle time between steps is
    in no sample, and the last sample outlives an idle spell, so a round after
    minutes of compute starts at the window the last one ended with.

    The shortest round trip is taken again once it is ``_FILTER_S`` old: from
    the next push sent. A window that was never idle in that time may hold a
    standing queue that every round trip since includes (its minimum would
    then count the queue as path and keep it); so it first drains to its
    count of pushes (``target`` 0) until a push sent after the drain answers,
    as BBR's PROBE_RTT does: one round trip in ``_FILTER_S`` at the floor.

    Args:
        clock: seconds, monotonic.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.delivered = 0  # request bytes answered so far
        self._min_rtt = 0.0  # 0: no sample yet
        self._min_rtt_at = 0.0
        self._probe_since: float | None = None  # pushes sent from then on measure the round trip afresh
        self._probe_min = math.inf
        self.draining = False  # the window is at its count until that measure comes
        self._rates: collections.deque[tuple[float, float]] = collections.deque()  # (when, bytes per second)
        self._recent: collections.deque[float] = collections.deque(maxlen=_RECENT)  # the latest round trips

    def sent(self, ahead: int = 0) -> tuple[float, int, bool]:
        """What to remember of a push going out with ``ahead`` others out: (now, bytes answered so far, probes)."""
        now = self._clock()
        if ahead == 0:
            # Nothing of this client's is on the path, so no queue of its making stands there: the late
            # answers of the last burst (a round's pushes wait for the other hosts' too) say nothing of the
            # next one, which would otherwise start an idle spell later at one product instead of two.
            self._recent.clear()
        if self._probe_since is None and self._min_rtt and now - self._min_rtt_at > _FILTER_S:
            self._probe_since, self._probe_min, self.draining = now, math.inf, ahead > 0
        # With at most one push ahead of it a push's round trip holds no standing queue of this client's.
        return now, self.delivered, self._probe_since is not None and ahead <= 1

    def answered(self, sent: tuple[float, int, bool], nbytes: int, measured: bool = True) -> None:
        """A push of ``nbytes`` sent at ``sent`` was answered; ``measured``: its round trip counts (not a retry)."""
        now = self._clock()
        self.delivered += nbytes
        if not measured:
            return
        rtt = max(now - sent[0], 1e-6)
        self._recent.append(rtt)
        if self._probe_since is not None and sent[0] >= self._probe_since:
            self._probe_min = min(self._probe_min, rtt)
            # A window that cannot drain (no count to fall to) ends its probe with the least it saw.
            if sent[2] or now - self._probe_since > _FILTER_S:
                self._min_rtt, self._min_rtt_at, self._probe_since = self._probe_min, now, None
                self.draining = False
                self._recent.clear()
        elif not self._min_rtt or rtt <= self._min_rtt:
            self._min_rtt, self._min_rtt_at = rtt, now
        horizon = now - max(_RATE_ROUNDS * self._min_rtt, _MIN_RATE_FILTER_S)
        while len(self._rates) > 1 and self._rates[0][0] < horizon:
            self._rates.popleft()
        rate = (self.delivered - sent[1]) / rtt
        while self._rates and self._rates[-1][1] <= rate:
            self._rates.pop()  # a monotonic deque: its head is the greatest rate of the recent samples
        self._rates.append((now, rate))

    def failed(self) -> None:
        """A push failed: forget the rates (the window falls to its floor and grows again as answers come)."""
        self._rates.clear()
        self._recent.clear()

    @property
    def min_rtt(self) -> float:
        """The shortest round trip seen recently, seconds (0: none yet)."""
        return self._min_rtt

    @property
    def rate(self) -> float:
        """The fastest delivery seen recently, bytes per second (0: none yet)."""
        return self._rates[0][1] if self._rates else 0.0

    @property
    def queueing(self) -> bool:
        """The latest answers all came much later than the shortest round trip: a queue is standing.

        All of them, not their mean: a push that waits for another rank's (a
        host behind, an aggregator busy) comes back late too, but the pushes
        beside it do not; a queue on the path delays every one.
        """
        if len(self._recent) < _RECENT:
            return False
        return min(self._recent) > _QUEUE_FACTOR * self.min_rtt

    def bdp(self) -> float:
        """The bandwidth-delay product, bytes: what the path holds in one round trip."""
        return self.rate * self.min_rtt

    def target(self) -> float:
        """The bytes a window should hold: twice the product, once while a queue builds, none while draining."""
        if self.draining:
            return 0.0
        return (1.0 if self.queueing else 2.0) * self.bdp()


class _Shard(Generic[T]):
    __slots__ = ("bytes", "path", "pushes", "sent", "waiting")

    def __init__(self, path: PathEstimate) -> None:
        self.pushes = 0
        self.bytes = 0
        self.waiting: collections.deque[tuple[T, int]] = collections.deque()
        self.path = path
        self.sent: dict[int, tuple[float, int, bool]] = {}  # id(item) -> what the path remembers of its send


class ShardWindow(Generic[T]):
    """Admission of pushes per shard: ``admit`` says whether to send now, ``release`` hands on the room.

    Args:
        shards: number of shards.
        limit: pushes in flight per shard however few bytes the path holds (the
            floor); None admits everything at once.
        settings: how the window grows past ``limit`` (see ``WindowSettings``).
    """

    def __init__(self, shards: int, limit: int | None, settings: WindowSettings | None = None) -> None:
        check_max_in_flight(limit)
        self.limit = limit
        self.settings = settings or WindowSettings()
        self._shards = [_Shard[T](self.settings.path_estimate()) for _ in range(shards)]
        self._lock = threading.Lock()
        self.closed = False

    def window_bytes(self, shard: int) -> int:
        """The request bytes ``shard`` may have in flight past its count of pushes, now."""
        with self._lock:
            return self._window_bytes(self._shards[shard])

    def _window_bytes(self, state: _Shard[T]) -> int:
        if not self.settings.sized_to_path:
            return 0
        return int(min(self.settings.max_bytes, state.path.target()))

    def in_flight(self, shard: int) -> tuple[int, int]:
        """(pushes, request bytes) of ``shard`` on the wire now."""
        with self._lock:
            state = self._shards[shard]
            return state.pushes, state.bytes

    def path(self, shard: int) -> PathEstimate:
        """``shard``'s path estimate (read it for figures; the window updates it)."""
        return self._shards[shard].path

    def connections(self, shard: int) -> int:
        """How many connections ``shard``'s window needs: one per send buffer of its bytes, 1..max_connections."""
        with self._lock:
            wanted = math.ceil(self._window_bytes(self._shards[shard]) / self.settings.connection_bytes)
        return max(1, min(self.settings.max_connections, wanted))

    def _fits(self, state: _Shard[T], nbytes: int) -> bool:
        if self.limit is None or state.pushes < self.limit:
            return True
        if state.pushes >= self.settings.max_pushes:
            return False
        return state.bytes + max(nbytes, 1) <= self._window_bytes(state)

    def _take(self, state: _Shard[T], item: T, nbytes: int) -> None:
        state.sent[id(item)] = state.path.sent(state.pushes)
        state.pushes += 1
        state.bytes += nbytes

    def admit(self, shard: int, item: T, nbytes: int = 0) -> bool:
        """True: send ``item`` (``nbytes`` on the wire) now and ``release`` it once it settles. False: it waits.

        A push waits while one is waiting before it (order is kept), else
        while the window is full. After ``close`` everything is sent at once,
        to fail on the closed channel. Without a limit every push is sent at
        once, and the window only measures the path (for ``connections``).
        """
        with self._lock:
            state = self._shards[shard]
            if self.closed or (not state.waiting and self._fits(state, nbytes)):
                self._take(state, item, nbytes)
                return True
            state.waiting.append((item, nbytes))
            return False

    def release(self, shard: int, item: T, nbytes: int = 0, answered: bool | None = True) -> list[T]:
        """``item`` (admitted with ``nbytes``) settled: the waiting items that now fit, in order, to send.

        ``answered``: True, the aggregator answered it at its first attempt
        (its round trip is measured); None, answered after a retry (counted,
        not measured); False, it failed (the rates are forgotten).
        """
        with self._lock:
            state = self._shards[shard]
            sent = state.sent.pop(id(item), None)
            state.pushes -= 1
            state.bytes -= nbytes
            if sent is not None:
                if answered is False:
                    state.path.failed()
                else:
                    state.path.answered(sent, nbytes, measured=bool(answered))
            started: list[T] = []
            while state.waiting and (self.closed or self._fits(state, state.waiting[0][1])):
                waiting, size = state.waiting.popleft()
                self._take(state, waiting, size)
                started.append(waiting)
            return started

    def drain(self, shard: int) -> list[T]:
        """The items waiting for ``shard``, removed (it is unreachable: they would only queue for a failure)."""
        with self._lock:
            state = self._shards[shard]
            items = [item for item, _ in state.waiting]
            state.waiting.clear()
            return items

    def close(self) -> list[T]:
        """Admit everything from now on; returns the items still waiting, removed."""
        with self._lock:
            self.closed = True
            items = [item for state in self._shards for item, _ in state.waiting]
            for state in self._shards:
                state.waiting.clear()
            return items
