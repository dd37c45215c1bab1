"""A shard's group: the ordered addresses of every shard of it, reported through the Shards RPC.

A worker given one shard's address asks it for the group and talks to every
shard, in the group's order (gradq.client.discovery). `gradq serve --shards N`
tells each of its shards the group (``--shard-group``); a shard run alone
answers an empty list, and a server older than the RPC answers UNIMPLEMENTED:
both mean a single shard. Entries may leave the host empty (":50052"): the
worker then uses the host it dialed, so the group holds whatever name the
workers reach the machine by.
"""

from __future__ import annotations

import grpc

from gradq.proto.v1 import aggregator_pb2 as pb

__all__ = ["parse_shard_group", "shards_handler", "split_address"]

_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name
_EXPECTED = "expected 'host:port[,host:port...]' (the host may be empty), ports in 1..65535, each address once"


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` (host possibly empty or ``[v6]``); None when it is not one."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in host):
        return None
    return host, int(port)


def parse_shard_group(text: str) -> tuple[str, ...]:
    """The shards' addresses, comma-separated, in shard order.

    Raises:
        ValueError: an entry is not ``host:port`` or names an address twice ("expected ...").
    """
    addresses = tuple(part.strip() for part in text.split(","))
    if not all(split_address(address) for address in addresses):
        raise ValueError(_EXPECTED)
    if len(set(addresses)) != len(addresses):
        raise ValueError(_EXPECTED)
    return addresses


def shards_handler(group: tuple[str, ...]) -> grpc.GenericRpcHandler:
    """The Aggregator service's Shards method, answering ``group`` (empty: this shard is alone).

    Registered beside the servicer's own handlers (gRPC asks each generic
    handler in turn), since the answer is the server's configuration, not round state.
    """
    answer = pb.ShardsResponse(addresses=list(group)).SerializeToString()

    async def shards(_request: bytes, _context: grpc.aio.ServicerContext) -> bytes:
        return answer

    handler = grpc.unary_unary_rpc_method_handler(
        shards, request_deserializer=lambda data: data, response_serializer=lambda data: data
    )
    return grpc.method_handlers_generic_handler(_SERVICE_NAME, {"Shards": handler})
