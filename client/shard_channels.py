"""The gRPC channels one client holds to its aggregator shards, by what each carries.

Per shard:

- its own channel: Join, Watch and Leave (gradq.client.membership). Nothing
  large goes on it, so the Watch's heartbeats wait behind no push
  (gradq.client.shard_connections says why that matters on slow links);
- a channel for the training state's and DiLoCo seeds' uploads, which go up
  in megabytes; gRPC connects a channel at its first call, so a job that never
  uploads never opens it;
- the push connections the shard's window asks for (``open_connection``),
  each a TCP connection of its own (gradq.proto.transport.channel_options).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

from gradq.client.push_stream import PushStream
from gradq.client.security import ChannelSecurity
from gradq.client.sending import UnaryPushes
from gradq.proto.transport import channel_options
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc

__all__ = ["ShardChannels"]

log = logging.getLogger(__name__)

# The connection index of a shard's state uploads: ShardConnections never opens one this high for pushes.
_STATE_CONNECTION = 1 << 16

# PushPull travels as bytes serde builds and parses itself (payload copied once each way).
_PUSH_PULL_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Aggregator'].full_name}/PushPull"
_PUSH_PULL_STREAM_METHOD = f"{_PUSH_PULL_METHOD}Stream"


class ShardChannels:
    """One client's channels to each of its shards: the shard's own, its uploads', and its push connections.

    Args:
        security: TLS / mutual TLS / bearer token of every channel (its metadata goes with every call).
        max_message_bytes: gRPC's send/receive limit.
        timeout_s: deadline of each push.
        push_stream: a push connection carries its pushes as the messages of one PushPullStream call;
            False makes one unary PushPull call per push.
    """

    def __init__(self, security: ChannelSecurity, max_message_bytes: int, timeout_s: float, push_stream: bool) -> None:
        self.security = security
        self.metadata = security.metadata()
        self.push_stream = push_stream
        self._max_message_bytes = max_message_bytes
        self._timeout_s = timeout_s
        self.addresses: list[str] = []
        self._own: list[grpc.Channel] = []
        self._uploads: list[grpc.Channel] = []
        self.stubs: list[pb_grpc.AggregatorStub] = []  # per shard, on its own channel
        self.upload_stubs: list[pb_grpc.AggregatorStub] = []  # per shard, on its uploads' channel

    def open(self, addresses: list[str]) -> None:
        """Channels for ``addresses``, in shard order: a shard's own channel already open is kept, the rest closed."""
        opened = dict(zip(self.addresses, self._own, strict=False))
        for address, channel in opened.items():
            if address not in addresses:
                channel.close()
        for channel in self._uploads:
            channel.close()
        self.addresses = list(addresses)
        own_options = channel_options(self._max_message_bytes)
        self._own = [opened.get(address) or self.security.channel(address, own_options) for address in addresses]
        upload_options = channel_options(self._max_message_bytes, connection=_STATE_CONNECTION)
        self._uploads = [self.security.channel(address, upload_options) for address in addresses]
        self.stubs = [pb_grpc.AggregatorStub(channel) for channel in self._own]
        self.upload_stubs = [pb_grpc.AggregatorStub(channel) for channel in self._uploads]

    def unary_pushes(self) -> list[UnaryPushes]:
        """Per shard, unary pushes on its own channel: for an aggregator that has no PushPullStream."""
        return [UnaryPushes(c.unary_unary(_PUSH_PULL_METHOD), self._timeout_s, self.metadata) for c in self._own]

    def open_connection(self, address: str, index: int) -> tuple[PushStream | UnaryPushes, Callable[[], None]]:
        """Push connection ``index`` (1, 2, ...) to the shard at ``address``: its transport and what closes it."""
        channel = self.security.channel(address, channel_options(self._max_message_bytes, connection=index))
        log.debug("opened connection %d to aggregator %s", index, address)
        if self.push_stream:
            call = functools.partial(channel.stream_stream(_PUSH_PULL_STREAM_METHOD), metadata=self.metadata)
            return PushStream(call, self._timeout_s), channel.close
        return UnaryPushes(channel.unary_unary(_PUSH_PULL_METHOD), self._timeout_s, self.metadata), channel.close

    def close(self) -> None:
        """Close every shard's own and uploads' channel (the push connections are their ShardConnections')."""
        for channel in self._own + self._uploads:
            channel.close()
