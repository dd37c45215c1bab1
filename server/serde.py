"""The aggregator's side of the wire: protobuf requests in, protobuf responses out.

The only server module that touches ``_pb2`` types (with the servicer's signatures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from gradq.proto.convert import parse_with_tensor, serialize_with_tensor, tensor_from_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantizedArray
from gradq.server.errors import InvalidArgumentError
from gradq.server.rounds import RoundResult

M = TypeVar("M", bound=Message)

__all__ = [
    "Contribution",
    "contribution_from_bytes",
    "contribution_from_proto",
    "result_to_bytes",
    "join_to_proto",
    "join_from_bytes",
    "leave_from_bytes",
]


@dataclass(frozen=True, slots=True)
class Contribution:
    """One rank's bucket for one round, checked and decoded from the wire."""

    job_id: str
    step: int
    bucket: int
    rank: int
    tensor: QuantizedArray
    non_finite: bool = False
    incarnation: str = ""


def contribution_from_proto(request: pb.PushPullRequest, payload: memoryview | bytes | None = None) -> Contribution:
    """Validate a PushPullRequest field by field (``payload``: its tensor's payload, when parsed apart).

    Raises:
        InvalidArgumentError: naming the field, its value and what was expected.
    """
    if not request.HasField("tensor"):
        raise InvalidArgumentError("tensor is missing; expected a QuantizedTensor with the bucket")
    try:
        tensor = tensor_from_proto(request.tensor, payload=payload)
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None
    return Contribution(
        request.job_id, request.step, request.bucket, request.rank, tensor, request.non_finite, request.incarnation
    )


def contribution_from_bytes(data: bytes) -> Contribution:
    """Parse and validate a serialized PushPullRequest; the payload stays a view into ``data``.

    Raises:
        InvalidArgumentError: the bytes are not a PushPullRequest, or a field is invalid.
    """
    try:
        request, payload = parse_with_tensor(data, pb.PushPullRequest, "tensor")
    except DecodeError as error:
        raise InvalidArgumentError(f"request is not a gradq.v1.PushPullRequest: {error}") from None
    return contribution_from_proto(request, payload)


def result_to_bytes(result: RoundResult) -> bytes:
    """The serialized PushPullResponse every waiter of a finished round receives."""
    response = pb.PushPullResponse(
        contributors=result.ranks,
        partial=result.partial,
        missing_ranks=result.missing,
        skipped=result.skipped,
    )
    return serialize_with_tensor(response, "mean", result.mean)


def join_to_proto(world_size: int, joined: int, server_id: str) -> pb.JoinResponse:
    """The answer to a Join: its size does not grow with the world size."""
    return pb.JoinResponse(world_size=world_size, joined=joined, server_id=server_id)


def join_from_bytes(data: bytes) -> pb.JoinRequest:
    """Parse a serialized JoinRequest.

    Raises:
        InvalidArgumentError: the bytes are not a JoinRequest.
    """
    return _parse(data, pb.JoinRequest)


def leave_from_bytes(data: bytes) -> pb.LeaveRequest:
    """Parse a serialized LeaveRequest.

    Raises:
        InvalidArgumentError: the bytes are not a LeaveRequest.
    """
    return _parse(data, pb.LeaveRequest)


def watch_from_bytes(data: bytes) -> pb.WatchRequest:
    """Parse a serialized WatchRequest.

    Raises:
        InvalidArgumentError: the bytes are not a WatchRequest.
    """
    return _parse(data, pb.WatchRequest)


def watch_event_to_bytes(joined: int) -> bytes:
    """The Watch stream's first message: the watch is in place."""
    return pb.WatchEvent(joined=joined).SerializeToString()


def _parse(data: bytes, message: type[M]) -> M:
    try:
        return message.FromString(data)
    except DecodeError as error:
        raise InvalidArgumentError(f"request is not a {message.DESCRIPTOR.full_name}: {error}") from None
