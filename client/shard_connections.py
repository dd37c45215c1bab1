"""Several connections to one shard, opened as its window asks for them, the pushes spread over them.

Linux caps what one TCP connection keeps unacknowledged at tcp_wmem[2]
(4 MiB by default): about 40 MB/s at 100 ms whatever the link. A shard whose
window holds more than that opens another connection, up to
``WindowSettings.max_connections``; a LAN's window never does. gRPC shares one
connection among channels whose arguments are equal, so each extra channel
gets its own subchannel pool and a distinct argument
(gradq.proto.transport.channel_options' ``connection``).

A push takes the open connection with the fewest bytes in flight among those
with room; a resend may take another: the aggregator counts a (step, round
key, rank) once whatever connection brought it. A new connection starts in
TCP's slow start (ten segments per round trip, doubling), so a megabyte put
on it at once waits several round trips (bench/wan_window.py --trace prints
each answer's time across a delay line). So a
connection has room for twice the bytes it has delivered so far (one push at
least), growing as TCP's window does.

The pushes leave the shard's own channel (its Join, Leave and Watch) to
itself: they go on connections of their own, the first opened at the first
push. TCP sends in order, so anything written on a connection waits behind
the megabytes of pushes queued on it: across a 4-8 Mbit/s link, seconds. The
Watch's heartbeats (gradq.client.membership) say this process lives; behind
pushes they were late by more than the aggregator's --keepalive-timeout and a
healthy host was lost. On a connection of their own they wait behind no push.
The push connections stay open until the client closes: the aggregator pings
each every second (gradq.server.app's keepalive), so a round after minutes of
compute finds them connected, their flow-control windows grown.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import grpc

__all__ = ["ShardConnections"]


class _Transport(Protocol):
    def send(self, request: bytes, sequence: int) -> Any: ...
    def close(self) -> None: ...


class ShardConnections:
    """A ``PushTransport`` over one or more connections to a shard, none of them the shard's own channel.

    Args:
        open_connection: opens connection ``index`` (1, 2, ...): its transport and what closes its channel.
            Index 0 is the shard's own channel (its Join, Watch and Leave), which carries no push.
        wanted: how many connections the shard's pushes need now (``ShardWindow.connections``, at least 1).
    """

    def __init__(
        self,
        open_connection: Callable[[int], tuple[_Transport, Callable[[], None]]],
        wanted: Callable[[], int],
    ) -> None:
        self._open_connection = open_connection
        self._wanted = wanted
        self._lock = threading.Lock()
        self._transports: list[_Transport] = []  # connection i + 1 at index i
        self._closers: list[Callable[[], None]] = []
        self._in_flight: list[int] = []  # request bytes not yet answered, per connection
        self._delivered: list[int] = []  # request bytes answered, per connection
        self._closed = False

    @property
    def transports(self) -> list[_Transport]:
        """The transports of the connections opened so far, in the order they opened."""
        with self._lock:
            return list(self._transports)

    @property
    def opened(self) -> int:
        """Connections opened for pushes so far."""
        return len(self._transports)

    def in_flight(self) -> list[int]:
        """Request bytes not yet answered on each connection."""
        with self._lock:
            return list(self._in_flight)

    def send(self, request: bytes, sequence: int) -> Any:
        """Send on the least loaded of the connections the window wants, opening any it lacks.

        Raises:
            ValueError: the transport is closed.
        """
        with self._lock:
            if self._closed:
                raise ValueError("the shard's connections are closed")
            needed = max(1, self._wanted())
            while len(self._transports) < needed:
                transport, closer = self._open_connection(len(self._transports) + 1)
                self._transports.append(transport)
                self._closers.append(closer)
                self._in_flight.append(0)
                self._delivered.append(0)
            size = len(request)
            usable = range(needed)
            roomy = [i for i in usable if not self._in_flight[i] or self._in_flight[i] + size <= 2 * self._delivered[i]]
            index = min(roomy or usable, key=self._in_flight.__getitem__)
            self._in_flight[index] += size
            transport = self._transports[index]
        try:
            reply = transport.send(request, sequence)
        except BaseException:
            self._settled(index, len(request))
            raise
        reply.add_done_callback(lambda done: self._settled(index, len(request), done.code() == grpc.StatusCode.OK))
        return reply

    def _settled(self, index: int, nbytes: int, delivered: bool = False) -> None:
        with self._lock:
            self._in_flight[index] -= nbytes
            self._delivered[index] += nbytes if delivered else 0

    def close(self) -> None:
        """Close every connection's transport, then its channel."""
        with self._lock:
            self._closed = True
            transports, closers = list(self._transports), list(self._closers)
        for transport in transports:
            transport.close()
        for closer in closers:
            closer()
