"""Is the aggregator there? What `gradq worker` and `gradq demo` check before they load torch and start ranks.

A rank that cannot reach its aggregator would otherwise learn it at its first
backward, after the rendezvous and the connect timeout, as a traceback from
inside autograd. This waits for the standard gRPC health check instead (no
token needed) and, when it fails, says what the address answered, as a
worker's first Join does (gradq.client.contact): a name that does not resolve
(at once), refused, timed out, TLS to a plaintext check, or the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradq.client.contact import check_resolvable, explain_no_answer
from gradq.client.security import ChannelSecurity
from gradq.client.sending import AggregationError

__all__ = ["wait_for_aggregators"]


def wait_for_aggregators(addresses: Sequence[str], timeout_s: float, security: ChannelSecurity | None = None) -> None:
    """Wait until every aggregator answers the health check with SERVING, up to ``timeout_s`` for each.

    Args:
        addresses: ``host:port`` of each shard.
        timeout_s: how long to wait for each shard to come up.
        security: TLS settings of the channels (the token is not needed).

    Raises:
        ValueError: an address is not host:port.
        AggregationError: a shard did not answer SERVING in time (an UnreachableError
            when it gave no answer: the message names it, how long it was tried and
            what the address answered), or its host name does not resolve.
    """
    check_resolvable(addresses)
    for address in addresses:
        _wait_for(address, timeout_s, security or ChannelSecurity())


def _wait_for(address: str, timeout_s: float, security: ChannelSecurity) -> None:
    with security.channel(address, []) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                details = f"the health check failed: {error.details()} (not a gradq aggregator?)"
                raise AggregationError(address, error.code(), details) from None
            raise explain_no_answer(AggregationError.of_call(address, error), security, timeout_s) from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        raise AggregationError(address, grpc.StatusCode.UNAVAILABLE, f"it answers {status} (shutting down?)")
