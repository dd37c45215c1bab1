"""A real aggregator on loopback, the window driven by an injected round trip: it grows, opens connections, shrinks.

Loopback has no delay, so the shortest round trip the window measures is
replaced by one the test sets (100 ms: a path between regions); the rates
are measured for real. Rank 1 holds its pushes back until rank 0 has
queued a step's, so rank 0's pushes stay in flight and what its window
admitted can be read off it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from gradq.client import WorkerClient, serde
from gradq.client.shard_connections import ShardConnections
from gradq.client.window import PathEstimate, WindowSettings
from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
ELEMENTS = 1 << 16  # 256 KiB a push
PUSH_BYTES = ELEMENTS * 4
CAP = 16 * PUSH_BYTES  # 4 MiB in flight at most
CONNECTION_BYTES = 4 * PUSH_BYTES
BUCKETS = 32
LOOPBACK_RATE = 1 << 30  # bytes per second


class InjectedPath(PathEstimate):
    """The path as measured, but with the shortest round trip the test sets."""

    rtt = 0.1

    @property
    def min_rtt(self) -> float:
        return InjectedPath.rtt

    @property
    def rate(self) -> float:
        # Once anything was answered, at least loopback's rate on an idle machine: a loaded one measures less
        # (a push waits for the other rank's), which would size the window below the cap the test reads.
        measured = super().rate
        return max(measured, LOOPBACK_RATE) if measured > 0 else 0.0


@pytest.fixture
def server() -> Iterator[AggregatorServer]:
    aggregator = AggregatorServer(RoundPolicy(world_size=2, round_timeout_s=20.0), ServerOptions("127.0.0.1:0"))
    aggregator.start()
    yield aggregator
    aggregator.stop()


@pytest.fixture
def clients(server: AggregatorServer) -> Iterator[list[WorkerClient]]:
    settings = WindowSettings(
        max_bytes=CAP, connection_bytes=CONNECTION_BYTES, max_connections=8, path_estimate=InjectedPath
    )
    address = f"127.0.0.1:{server.port}"
    made = [
        WorkerClient(address, "paths", rank, 2, EXACT, chunk_elements=0, max_in_flight=2, window=settings)
        for rank in range(2)
    ]
    for client in made:
        client.join()
    yield made
    for client in made:
        client.close()


def values(rank: int, step: int, bucket: int) -> np.ndarray:
    return np.full(ELEMENTS, rank * 1000 + step * 10 + bucket, np.float32)


def step(clients: list[WorkerClient], number: int) -> tuple[int, int]:
    """Rank 0 queues the step's buckets, then rank 1 pushes: returns rank 0's (pushes, bytes) in flight meanwhile."""
    first = [clients[0].push_pull_async(number, bucket, values(0, number, bucket)) for bucket in range(BUCKETS)]
    held = clients[0]._sender.window.in_flight(0)
    second = [clients[1].push_pull_async(number, bucket, values(1, number, bucket)) for bucket in range(BUCKETS)]
    for bucket, (a, b) in enumerate(zip(first, second, strict=True)):
        expected = (values(0, number, bucket) + values(1, number, bucket)) / 2
        np.testing.assert_array_equal(a.result(timeout=30), expected)
        np.testing.assert_array_equal(b.result(timeout=30), expected)
    return held


def test_pushes_in_flight_grow_to_the_path_over_several_connections_and_shrink_back(
    clients: list[WorkerClient],
) -> None:
    InjectedPath.rtt = 0.1
    # The first step: no answer yet, so the window holds its count of pushes.
    pushes, in_flight = step(clients, 0)
    request_bytes = in_flight // 2  # a push's request: its payload and a few dozen bytes of fields
    assert pushes == 2 and PUSH_BYTES < request_bytes < PUSH_BYTES + 256
    # Answers measured a rate: at 100 ms loopback's rate holds far more than the cap, which the window fills.
    pushes, in_flight = step(clients, 1)
    assert pushes == CAP // request_bytes and in_flight <= CAP, (pushes, in_flight)
    window = clients[0]._sender.window
    assert window.window_bytes(0) == CAP
    transport = clients[0]._sender.transports[0]
    assert isinstance(transport, ShardConnections)
    # One connection per send buffer of the window, none of them the shard's own channel (its Join and Watch).
    assert transport.opened == CAP // CONNECTION_BYTES
    # The path shortens (a LAN): the window falls back to its count, the connections stay open for later.
    InjectedPath.rtt = 1e-6
    assert step(clients, 2)[0] == 2
    assert window.connections(0) == 1 and transport.opened == CAP // CONNECTION_BYTES


def test_a_resend_on_another_connection_is_counted_once(server: AggregatorServer, clients: list[WorkerClient]) -> None:
    InjectedPath.rtt = 0.1
    step(clients, 0)
    step(clients, 1)  # the window now wants several connections
    transport = clients[0]._sender.transports[0]
    assert isinstance(transport, ShardConnections) and transport.opened > 1
    run = clients[0].membership.incarnations[0]
    mine = serde.push_pull_request("paths", 2, 0, 0, encode(values(0, 2, 0), EXACT), incarnation=run, sequence=10**6)
    resend = serde.push_pull_request(
        "paths", 2, 0, 0, encode(values(0, 2, 0), EXACT), incarnation=run, sequence=10**6 + 1
    )
    sent = transport.send(mine, 10**6)
    again = transport.send(resend, 10**6 + 1)  # one connection holds the first copy: the least loaded is another
    assert sum(1 for loaded in transport.in_flight() if loaded) == 2, "both copies went on one connection"
    counted = server.table.counters["contributions"]
    other = clients[1].push_pull_async(2, 0, values(1, 2, 0))
    expected = (values(0, 2, 0) + values(1, 2, 0)) / 2
    np.testing.assert_array_equal(other.result(timeout=30), expected)  # rank 0's push counted once, not twice
    for reply in (sent, again):
        mean = serde.mean_from_bytes(_settled(reply), ELEMENTS)
        np.testing.assert_array_equal(decode(mean.tensor), expected)
    assert server.table.counters["contributions"] == counted + 2  # two ranks in the round


def _settled(reply: object, timeout_s: float = 30.0) -> bytes:
    done = threading.Event()
    reply.add_done_callback(lambda _: done.set())  # type: ignore[attr-defined]
    assert done.wait(timeout_s), "no answer to the push"
    assert reply.code().name == "OK", reply.details()  # type: ignore[attr-defined]
    return bytes(reply.result())  # type: ignore[attr-defined]


class FakeReply:
    """A push's answer the test settles."""

    def __init__(self) -> None:
        self.callbacks: list[object] = []
        self.status = grpc.StatusCode.OK

    def code(self) -> grpc.StatusCode:
        return self.status

    def add_done_callback(self, callback: object) -> None:
        self.callbacks.append(callback)

    def settle(self) -> None:
        for callback in self.callbacks:
            callback(self)  # type: ignore[operator]


class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[FakeReply] = []
        self.closed = False

    def send(self, request: bytes, sequence: int) -> FakeReply:
        reply = FakeReply()
        self.sent.append(reply)
        return reply

    def close(self) -> None:
        self.closed = True


def test_new_connections_take_twice_what_they_delivered_and_leave_the_shards_channel_to_its_watch() -> None:
    opened: list[FakeTransport] = []
    closed: list[int] = []

    def open_connection(index: int) -> tuple[FakeTransport, Callable[[], None]]:
        opened.append(FakeTransport())
        return opened[-1], lambda: closed.append(index)

    wanted = [1]
    connections = ShardConnections(open_connection, lambda: wanted[0])
    push = b"x" * 1000
    warm = [connections.send(push, sequence) for sequence in range(4)]  # one connection: all on it
    assert connections.opened == 1 and len(opened[0].sent) == 4
    for reply in warm:
        reply.settle()  # it delivered 4000 bytes
    wanted[0] = 2
    for sequence in range(4, 7):
        connections.send(push, sequence)
    # The new one takes one push, then has no room until it delivers; the warm one takes the rest.
    assert [len(extra.sent) for extra in opened] == [6, 1]
    opened[1].sent[0].settle()  # it delivered a push: room for two
    for sequence in range(7, 10):
        connections.send(push, sequence)
    # Two went to the new connection (the less loaded, with room), the third to the other with room.
    assert [len(extra.sent) for extra in opened] == [7, 3]
    assert connections.in_flight() == [3000, 2000]
    # Connection 0 is the shard's own channel (its Join and Watch): no push is ever sent on it.
    assert closed == [] and connections.transports == opened
    connections.close()
    assert all(extra.closed for extra in opened) and closed == [1, 2]
    with pytest.raises(ValueError, match="closed"):
        connections.send(push, 99)
