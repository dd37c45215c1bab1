"""Is the aggregator there? What `gradq worker` and `gradq demo` check before they load torch and start ranks.

A rank that cannot reach its aggregator would otherwise learn it at its first
backward, after the rendezvous and the connect timeout, as a traceback from
inside autograd. This waits for the standard gRPC health check instead (no
token needed) and, when it fails, says what the address answered: nothing,
TLS to a plaintext check, or plaintext to a TLS one.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradq.client.security import ChannelSecurity
from gradq.client.sending import AggregationError
from gradq.proto.transport import speaks_tls

__all__ = ["wait_for_aggregators"]


def wait_for_aggregators(addresses: Sequence[str], timeout_s: float, security: ChannelSecurity | None = None) -> None:
    """Wait until every aggregator answers the health check with SERVING, up to ``timeout_s`` for each.

    Args:
        addresses: ``host:port`` of each shard.
        timeout_s: how long to wait for each shard to come up.
        security: TLS settings of the channels (the token is not needed).

    Raises:
        AggregationError: a shard did not answer SERVING in time; the message
            names it, how long it was tried and, where the cause can be told,
            the cause.
    """
    for address in addresses:
        _wait_for(address, timeout_s, security or ChannelSecurity())


def _wait_for(address: str, timeout_s: float, security: ChannelSecurity) -> None:
    with security.channel(address, []) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as error:
            # Waiting for readiness, only the deadline ends the call without an answer.
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                cause = _cause(address, over_tls=security.root_certificates is not None)
                details = f"no answer, tried for {timeout_s:g} s: {cause}"
            else:
                details = f"the health check failed: {error.details()} (not a gradq aggregator?)"
            raise AggregationError(address, error.code(), details) from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        raise AggregationError(address, grpc.StatusCode.UNAVAILABLE, f"it answers {status} (shutting down?)")


def _cause(address: str, over_tls: bool) -> str:
    """What the address answers, and which variables (flags of the same name in `gradq worker`) would fix it."""
    tls = speaks_tls(address)
    if tls is None:
        return "nothing accepts connections at that host and port"
    if tls and not over_tls:
        return (
            "it answers TLS, so the aggregator may be serving TLS: give the CA that signed its certificate "
            "(GRADQ_TLS_CA)"
        )
    if not tls and over_tls:
        return "it answers plaintext, not TLS: leave GRADQ_TLS_CA unset"
    if over_tls:
        return (
            "it serves TLS but the handshake fails: check that GRADQ_TLS_CA is the CA that signed its certificate "
            "and, under mutual TLS, set GRADQ_TLS_CLIENT_CERT and GRADQ_TLS_CLIENT_KEY"
        )
    return "it accepts connections but gives no gRPC answer (not a gradq aggregator?)"
