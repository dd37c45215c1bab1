"""Round errors as plain exceptions, each naming the gRPC status it maps to.

The round logic stays free of grpc; the servicer turns ``code`` into a status.
"""

from __future__ import annotations

import enum

__all__ = [
    "Refusal",
    "RoundError",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "PermissionDeniedError",
    "RoundAbortedError",
    "UnavailableError",
    "ResourceExhaustedError",
    "CancelledError",
]


class Refusal(enum.Enum):
    """Why a call was refused, as the client acts on it; mirrors the proto enum Refusal (parity-tested).

    The servicer sends the name as the trailing metadata ``gradq-refusal`` (and
    in a stream's in-band refusal), so no client decision reads the message.
    """

    UNSPECIFIED = 0
    UNKNOWN_JOB = 1
    NOT_JOINED = 2
    PENDING = 3
    LOST = 4
    LATE = 5
    ANOTHER_RUN = 6
    MODEL_MISMATCH = 7
    BEHIND = 8
    JOB_ENDED = 9


class RoundError(Exception):
    """Base class: ``code`` is the name of a ``grpc.StatusCode``; ``refusal`` says why, for the client."""

    code = "INTERNAL"

    def __init__(self, message: str = "", refusal: Refusal = Refusal.UNSPECIFIED) -> None:
        super().__init__(message)
        self.refusal = refusal


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
