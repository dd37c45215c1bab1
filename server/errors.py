"""Round errors as plain exceptions, each naming the gRPC status it maps to.

The round logic stays free of grpc; the servicer turns ``code`` into a status.
"""

from __future__ import annotations

__all__ = [
    "RoundError",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "PermissionDeniedError",
    "RoundAbortedError",
    "UnavailableError",
    "ResourceExhaustedError",
    "CancelledError",
]


class RoundError(Exception):
    """Base class: ``code`` is the name of a ``grpc.StatusCode``."""

    code = "INTERNAL"


class InvalidArgumentError(RoundError):
    """The request itself is malformed (bad field value); retrying cannot help."""

    code = "INVALID_ARGUMENT"


class FailedPreconditionError(RoundError):
    """The request is well formed but does not fit the job's state (not joined, stale step)."""

    code = "FAILED_PRECONDITION"


class RoundAbortedError(RoundError):
    """The round closed without this rank's answer (deadline passed with ranks missing)."""

    code = "ABORTED"


class UnavailableError(RoundError):
    """The aggregator is shutting down; the client may retry elsewhere or later."""

    code = "UNAVAILABLE"


class PermissionDeniedError(RoundError):
    """The caller is authenticated but may not act as the rank it claims."""

    code = "PERMISSION_DENIED"


class ResourceExhaustedError(RoundError):
    """A limit of this aggregator (memory budget, waiting calls, jobs) is reached; retry later."""

    code = "RESOURCE_EXHAUSTED"


class CancelledError(RoundError):
    """The client gave up (deadline passed or cancelled); nothing is waiting for the answer."""

    code = "CANCELLED"
