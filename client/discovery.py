"""A worker given one shard's address learns the other shards of its group from it (the Shards RPC).

`gradq serve --shards N` tells each shard the group's addresses in shard
order (gradq.server.shard_group); a worker configured with one address asks
that shard, before it joins, and talks to every shard of the group in that
order, so the configuration names one address however many shards there are.
An entry whose host is empty or a wildcard (``:50052``, ``0.0.0.0:50052``)
stands for the host the worker dialed. A shard alone answers an empty group
and a server older than the RPC answers UNIMPLEMENTED: both leave the one
address as it is. The worker imports no server code: an address's form is
gradq.proto.address's, which both sides read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from gradq.client.sending import AggregationError
from gradq.proto.address import split_address
from gradq.proto.v1 import aggregator_pb2 as pb

__all__ = ["discover_shards", "resolve_group"]

log = logging.getLogger(__name__)

# Hosts a shard may advertise that mean "the host the worker dialed".
_WILDCARDS = ("", "0.0.0.0", "[::]")
_MALFORMED = grpc.StatusCode.FAILED_PRECONDITION  # a configuration to fix, never a reason to fall back


def discover_shards(
    stub: object, address: str, timeout_s: float, metadata: Sequence[tuple[str, str]] | None
) -> list[str]:
    """The addresses a worker given only ``address`` talks to: its group's in shard order, or ``[address]``.

    Args:
        stub: an AggregatorStub on ``address``'s channel.
        address: the one ``host:port`` the worker was given.
        timeout_s: how long to wait for the shard to answer (it may still be starting).
        metadata: the calls' metadata (the bearer token).

    Raises:
        AggregationError: the shard could not be reached (its code, e.g.
            UNAVAILABLE, as a Join's would be), or its group is malformed or
            does not contain ``address`` (FAILED_PRECONDITION).
    """
    try:
        response = stub.Shards(  # type: ignore[attr-defined]
            pb.ShardsRequest(), timeout=timeout_s, wait_for_ready=True, metadata=metadata
        )
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            return [address]  # a server from before the Shards RPC: one shard
        raise AggregationError.of_call(address, error) from None
    group = resolve_group(address, list(response.addresses))
    if len(group) > 1:
        log.info("aggregator %s is shard %d of %d: %s", address, group.index(address), len(group), ",".join(group))
    return group


def resolve_group(address: str, advertised: Sequence[str]) -> list[str]:
    """The group ``advertised`` by the shard at ``address``, each wildcard host replaced by the host dialed.

    Args:
        address: the ``host:port`` the worker dialed.
        advertised: the shard's answer, in shard order (empty: the shard is alone).

    Returns:
        The shards' addresses in shard order (``[address]`` for a shard alone).

    Raises:
        AggregationError: FAILED_PRECONDITION, naming the group: an entry is not
            ``host:port``, an address repeats, or the group lacks ``address``.
    """
    if not advertised:
        return [address]
    listed = ",".join(advertised)
    dialed = _split(address)
    group: list[str] = []
    for entry in advertised:
        parts = _split(entry)
        if parts is None:
            raise AggregationError(
                address,
                _MALFORMED,
                f"the shard reports its group as {listed!r}, and {entry!r} is not 'host:port'; expected host:port "
                "entries in shard order (the host may be empty), ports in 1..65535",
            )
        host, port = parts
        if host in _WILDCARDS:
            if dialed is None:
                raise AggregationError(
                    address,
                    _MALFORMED,
                    f"the shard reports its group as {listed!r}, whose entry {entry!r} stands for the host dialed, "
                    f"but {address!r} is not 'host:port'; dial host:port, or list every shard in addresses",
                )
            host = dialed[0]
        group.append(f"{host}:{port}")
    if len(set(group)) != len(group):
        raise AggregationError(
            address,
            _MALFORMED,
            f"the shard reports its group as {listed!r}, which names an address twice ({','.join(group)}); expected "
            "each shard once",
        )
    if address not in group:
        raise AggregationError(
            address,
            _MALFORMED,
            f"the shard reports a group that does not contain it: {','.join(group)} (as advertised: {listed!r}); "
            f"expected {address} among them: set the shards' --advertise-host to the host workers dial, or list "
            "every shard in addresses",
        )
    return group


def _split(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` (the host possibly empty or ``[v6]``); None when it is not one."""
    try:
        return split_address(address, host_required=False)
    except ValueError:
        return None
