"""A client host that opens more push streams than --max-streams-per-peer, over many connections, is refused by name.

The streams are counted per client host, not per connection: a rank opens
one per connection to a shard, and a host opening connections without end
must not get a stream on each. Another host's job is served meanwhile.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from waiting import wait_until

from gradq.client import WorkerClient
from gradq.proto.transport import channel_options
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy

STREAM_METHOD = "/gradq.v1.Aggregator/PushPullStream"
EXACT = QuantConfig(scheme=Scheme.FLOAT32)
CAP = 3
HOSTILE = "ipv4:127.0.0.1"


@pytest.fixture
def server() -> Iterator[AggregatorServer]:
    # Listening on every address: the hostile host comes over IPv4 loopback, the honest job over IPv6's.
    aggregator = AggregatorServer(
        RoundPolicy(world_size=2, round_timeout_s=10.0),
        ServerOptions("[::]:0", grace_s=1.0),
        ServiceLimits(max_streams_per_peer=CAP),
    )
    aggregator.start()
    yield aggregator
    aggregator.stop()


class IdleStream:
    """A PushPullStream call on a connection of its own that sends nothing until closed."""

    def __init__(self, address: str, channel: grpc.Channel | None = None, connection: int = 1) -> None:
        self.own_channel = channel is None
        self.channel = channel or grpc.insecure_channel(address, options=channel_options(connection=connection))
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.call = self.channel.stream_stream(STREAM_METHOD)(iter(self.outbox.get, None))

    def refusal(self, timeout_s: float = 10.0) -> grpc.RpcError | None:
        """The error the call ended with, or None if it is still open after ``timeout_s``."""
        ended = threading.Event()
        self.call.add_done_callback(lambda _: ended.set())
        if not ended.wait(timeout_s):
            return None
        try:
            next(self.call)
        except grpc.RpcError as error:
            return error
        raise AssertionError("the idle stream got an answer")

    def close(self) -> None:
        self.outbox.put(None)
        self.call.cancel()
        if self.own_channel:
            self.channel.close()


def wait_for_streams(server: AggregatorServer, peer: str, count: int, timeout_s: float = 10.0) -> None:
    wait_until(
        lambda: server.servicer.waiting.streams(peer) == count,
        f"{count} streams of {peer}",
        timeout_s,
        detail=lambda: f"{server.servicer.waiting.streams(peer)} open",
    )


def test_streams_past_the_cap_are_refused_by_name_over_any_connection_and_another_host_is_served(
    server: AggregatorServer,
) -> None:
    ipv4 = f"127.0.0.1:{server.port}"
    streams = [IdleStream(ipv4, connection=index + 1) for index in range(CAP)]  # a connection each
    extra: list[IdleStream] = []
    try:
        wait_for_streams(server, HOSTILE, CAP)
        # More connections, and more streams on a connection already open: refused alike.
        extra = [IdleStream(ipv4, connection=CAP + 1), IdleStream(ipv4, channel=streams[0].channel)]
        for stream in extra:
            error = stream.refusal()
            assert error is not None, "a stream past the cap was served"
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"client {HOSTILE} has {CAP} push streams open" in (error.details() or "")
            assert f"--max-streams-per-peer={CAP}" in (error.details() or "")
        assert all(stream.refusal(timeout_s=0.2) is None for stream in streams), "a stream within the cap ended"
        assert server.servicer.waiting.streams(HOSTILE) == CAP
        # Another host's job gets its exact means meanwhile, over streams of its own.
        ipv6 = f"[::1]:{server.port}"
        clients = [WorkerClient(ipv6, "honest", rank, 2, EXACT) for rank in range(2)]
        for client in clients:
            client.join()
        futures = [
            client.push_pull_async(0, 0, np.full(64, rank + 1.0, np.float32)) for rank, client in enumerate(clients)
        ]
        for future in futures:
            np.testing.assert_array_equal(future.result(timeout=10), np.full(64, 1.5, np.float32))
        for client in clients:
            client.close()
        # A stream that ends hands its place back: the host may open one again.
        streams.pop().close()
        wait_for_streams(server, HOSTILE, CAP - 1)
        streams.append(IdleStream(ipv4, connection=CAP + 2))
        wait_for_streams(server, HOSTILE, CAP)
        assert streams[-1].refusal(timeout_s=0.2) is None
    finally:
        for stream in streams + extra:
            stream.close()
    wait_for_streams(server, HOSTILE, 0)
