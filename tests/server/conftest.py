"""Fixtures: real aggregators on port 0 and raw stubs talking to them over real channels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

StartAggregator = Callable[..., AggregatorServer]


@pytest.fixture
def start_aggregator() -> Iterator[StartAggregator]:
    """Start aggregators with a given policy; all are stopped at teardown."""
    servers: list[AggregatorServer] = []

    def start(policy: RoundPolicy | None = None, **options: object) -> AggregatorServer:
        server = AggregatorServer(
            policy or RoundPolicy(round_timeout_s=5.0),
            ServerOptions(address="127.0.0.1:0", grace_s=1.0, **options),  # type: ignore[arg-type]
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def stub_for() -> Iterator[Callable[[AggregatorServer], pb_grpc.AggregatorStub]]:
    """A raw Aggregator stub on a real channel to a started server."""
    channels: list[grpc.Channel] = []

    def make(server: AggregatorServer) -> pb_grpc.AggregatorStub:
        channel = grpc.insecure_channel(
            f"127.0.0.1:{server.port}",
            options=[("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)],
        )
        channels.append(channel)
        return pb_grpc.AggregatorStub(channel)

    yield make
    for channel in channels:
        channel.close()
