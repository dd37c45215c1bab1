"""ShardWindow: at most N pushes per shard on the wire at once, the rest waiting in order.

gRPC multiplexes every call to a shard over one HTTP/2 connection, so a step's
chunks, sent all at once, share the shard's inbound link and arrive together
at the end; only then do their means go out. With two in flight, one chunk
arrives while the mean of the one before leaves, so a shard's inbound and
outbound links work at the same time: at 100 Mbit/s, world 4, two shards and
2^17-element chunks the 8-bit step went from 1439 to 1064 ms (its link needs
951 ms; bench/network.py).

A waiting push starts only when one of the same shard settles, so every rank
must push in the same order (DDP's hook does): two ranks each holding the
other's next rounds behind their own would wait until the round deadline.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

__all__ = ["ShardWindow", "check_max_in_flight"]

T = TypeVar("T")


def check_max_in_flight(limit: int | None) -> None:
    """Raise ValueError unless ``limit`` is an integer >= 1 or None."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"max_in_flight={limit!r} is invalid; expected an integer >= 1, or None for no limit")


class ShardWindow(Generic[T]):
    """Admission of pushes per shard: ``admit`` says whether to send now, ``release`` hands on the slot.

    Args:
        shards: number of shards.
        limit: pushes in flight per shard; None admits everything at once.
    """

    def __init__(self, shards: int, limit: int | None) -> None:
        check_max_in_flight(limit)
        self.limit = limit
        self._in_flight = [0] * shards
        self._waiting: list[collections.deque[T]] = [collections.deque() for _ in range(shards)]
        self._lock = threading.Lock()
        self.closed = False

    def admit(self, shard: int, item: T) -> bool:
        """True: send ``item`` now and ``release`` once it settles. False: it waits its turn.

        After ``close`` everything is sent at once, to fail on the closed channel.
        """
        if self.limit is None:
            return True
        with self._lock:
            if self.closed or self._in_flight[shard] < self.limit:
                self._in_flight[shard] += 1
                return True
            self._waiting[shard].append(item)
            return False

    def release(self, shard: int) -> T | None:
        """A push on ``shard`` settled: the next waiting item, which takes over its slot, or None."""
        if self.limit is None:
            return None
        with self._lock:
            if self._waiting[shard]:
                return self._waiting[shard].popleft()
            self._in_flight[shard] -= 1
            return None

    def drain(self, shard: int) -> list[T]:
        """The items waiting for ``shard``, removed (it is unreachable: they would only queue for a failure)."""
        with self._lock:
            items = list(self._waiting[shard])
            self._waiting[shard].clear()
            return items

    def close(self) -> list[T]:
        """Admit everything from now on; returns the items still waiting, removed."""
        with self._lock:
            self.closed = True
            items = [item for waiting in self._waiting for item in waiting]
            for waiting in self._waiting:
                waiting.clear()
            return items
