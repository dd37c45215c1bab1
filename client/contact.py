"""A worker's first contact with its aggregators: a name that does not resolve fails at once, a failed wait says why.

gRPC waits out the whole connect timeout (``wait_for_ready``) for an address
that can never answer and then reports DEADLINE_EXCEEDED, whatever the cause.
Before the first call, every host is resolved here (an unresolvable name is
a typo, not a server still starting); after a call that got no answer, the
address is probed (gradq.proto.address) and the error says what it answered:
refused, timed out, TLS to a plaintext client or the reverse. The words name
the worker's variables (`gradq worker --help` shows each beside its flag).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from gradq.client.security import ChannelSecurity
from gradq.client.sending import AggregationError
from gradq.proto.address import Answer, Reach, describe_no_answer, probe_address, resolution_failure

__all__ = ["UnreachableError", "check_resolvable", "explain_no_answer"]

# How the worker's settings are named in what it is told to change.
_CA = "GRADQ_TLS_CA"
_CLIENT_PAIR = "GRADQ_TLS_CLIENT_CERT and GRADQ_TLS_CLIENT_KEY"
# TLS against plaintext: the channel's settings are wrong, the aggregator is there.
_MISMATCH = grpc.StatusCode.FAILED_PRECONDITION
# How long the probe of an address that gave no answer waits for a connection and a handshake.
_PROBE_TIMEOUT_S = 2.0


class UnreachableError(AggregationError):
    """An aggregator a worker got no answer from; its message (one line) says why, ``reach`` what was found there.

    Its code is the call's, but for TLS against plaintext (either way): FAILED_PRECONDITION, a
    configuration to fix and never a reason to fall back, as a malformed shard group is.
    """

    def __init__(self, address: str, code: grpc.StatusCode, details: str, reach: Reach) -> None:
        super().__init__(address, code, details)
        self.reach = reach


def check_resolvable(addresses: Sequence[str]) -> None:
    """Resolve every address's host now, before any call waits for it.

    Raises:
        UnreachableError: UNAVAILABLE, ``cannot resolve HOST: ...``, naming GRADQ_AGGREGATORS.
        ValueError: an address is not host:port.
    """
    for address in addresses:
        try:
            reach = resolution_failure(address)
        except ValueError as error:
            raise ValueError(f"addresses={address!r} (GRADQ_AGGREGATORS) is invalid; {error}") from None
        if reach is not None:
            details = describe_no_answer(address, reach, False, 0.0, _CA, _CLIENT_PAIR)
            raise UnreachableError(
                address, grpc.StatusCode.UNAVAILABLE, f"{details} in addresses (GRADQ_AGGREGATORS)", reach
            )


def explain_no_answer(error: AggregationError, security: ChannelSecurity | None, waited_s: float) -> AggregationError:
    """``error`` with the cause said, when it is a call that waited ``waited_s`` for an aggregator and got no answer.

    Only a DEADLINE_EXCEEDED is probed: a call waiting for readiness ends so when no connection was made
    (any other code is the aggregator's own answer, and is returned as it is).

    Args:
        error: the failed call's error.
        security: the channel's settings (TLS or plaintext).
        waited_s: how long the call waited.

    Returns:
        An UnreachableError naming the cause (FAILED_PRECONDITION for TLS against
        plaintext), or ``error`` itself.
    """
    if error.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return error
    try:
        reach = probe_address(error.address, _PROBE_TIMEOUT_S)
    except ValueError:  # not host:port (a caller that skipped the configuration's check): nothing to probe
        return error
    over_tls = security is not None and security.root_certificates is not None
    details = describe_no_answer(error.address, reach, over_tls, waited_s, _CA, _CLIENT_PAIR)
    mismatch = reach.answer is (Answer.PLAINTEXT if over_tls else Answer.TLS)
    return UnreachableError(error.address, _MISMATCH if mismatch else error.code, details, reach)
