"""The aggregator's side of the wire: protobuf requests in, protobuf responses out.

The only server module that touches ``_pb2`` types (with the servicer's signatures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
from google.protobuf.message import DecodeError, Message

from gradq.proto.convert import parse_with_tensor, serialize_with_tensor, tensor_from_proto
from gradq.proto.transport import bounded_details
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantizedArray
from gradq.qcore.outer_step import OuterStep
from gradq.server.errors import InvalidArgumentError
from gradq.server.job_spec import JobSpec, MemberRole
from gradq.server.rounds import RoundResult
from gradq.server.semi_sync import SemiSync

M = TypeVar("M", bound=Message)

__all__ = [
    "Contribution",
    "contribution_from_bytes",
    "contribution_from_proto",
    "push_from_bytes",
    "StreamedPush",
    "streamed_push_from_bytes",
    "streamed_answer",
    "streamed_refusal",
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
    weight: int = 0  # in a weighted job, what the push stands for (checked against the job: RoundTable.admit)


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
        request.job_id,
        request.step,
        request.bucket,
        request.rank,
        tensor,
        request.non_finite,
        request.incarnation,
        request.weight,
    )


def push_from_bytes(data: bytes) -> tuple[pb.PushPullRequest, memoryview | bytes]:
    """Parse a serialized PushPullRequest, its payload apart (a view into ``data``), checking no field.

    Raises:
        InvalidArgumentError: the bytes are not a PushPullRequest.
    """
    try:
        return parse_with_tensor(data, pb.PushPullRequest, "tensor")
    except DecodeError as error:
        raise InvalidArgumentError(f"request is not a gradq.v1.PushPullRequest: {error}") from None


def contribution_from_bytes(data: bytes) -> Contribution:
    """Parse and validate a serialized PushPullRequest; the payload stays a view into ``data``.

    Raises:
        InvalidArgumentError: the bytes are not a PushPullRequest, or a field is invalid.
    """
    return contribution_from_proto(*push_from_bytes(data))


@dataclass(frozen=True, slots=True)
class StreamedPush:
    """A PushPullStream message: what names its answer, and its contribution or why a field is invalid."""

    sequence: int
    round_answers: bool  # its client takes the round's shared answer (sequence 0) as this push's
    parsed: Contribution | InvalidArgumentError


def streamed_push_from_bytes(data: bytes) -> StreamedPush:
    """Parse a PushPullStream message; a field that is invalid is returned, not raised, to answer in-band.

    Raises:
        InvalidArgumentError: the bytes are not a PushPullRequest (there is no sequence to answer with).
    """
    request, payload = push_from_bytes(data)
    parsed: Contribution | InvalidArgumentError
    try:
        parsed = contribution_from_proto(request, payload)
    except InvalidArgumentError as error:
        parsed = error
    return StreamedPush(request.sequence, request.round_answers, parsed)


def streamed_answer(packaged: bytes, sequence: int) -> bytes:
    """A finished round's PushPullResponse (``packaged``) as the answer to one push of a PushPullStream.

    For a client that names its pushes by sequence only (``round_answers``
    unset): concatenated protobuf messages parse as one with the fields of
    both, so the push's sequence is appended to a copy of the bytes every
    waiter shares. A client that sets ``round_answers`` gets ``packaged``
    itself, which names its round.
    """
    return packaged + pb.PushPullResponse(sequence=sequence).SerializeToString()


def streamed_refusal(sequence: int, code: int, details: str, refusal: int = 0) -> bytes:
    """The answer to a PushPullStream push refused with status ``code`` (a google.rpc.Code): no mean.

    The details are cut to ``MAX_DETAILS_CHARACTERS``: a stream may hold many refusals its client has not
    read yet, and none may cost more than a line because a request field was long.
    """
    reason = cast("pb.Refusal", refusal)
    response = pb.PushPullResponse(sequence=sequence, code=code, details=bounded_details(details), refusal=reason)
    return response.SerializeToString()


def result_to_bytes(result: RoundResult, incarnation: str, step: int, bucket: int) -> bytes:
    """The serialized PushPullResponse every waiter of a finished round receives, naming the round."""
    response = pb.PushPullResponse(
        contributors=result.ranks,
        partial=result.partial,
        missing_ranks=result.missing,
        skipped=result.skipped,
        step=step,
        bucket=bucket,
        incarnation=incarnation,
    )
    return serialize_with_tensor(response, "mean", result.mean)


def join_to_proto(
    world_size: int, joined: int, server_id: str, rank: int = 0, incarnation: str = "", catch_up: bool = False
) -> pb.JoinResponse:
    """The answer to a Join: its size does not grow with the world size."""
    return pb.JoinResponse(
        world_size=world_size,
        joined=joined,
        server_id=server_id,
        rank=rank,
        incarnation=incarnation,
        catch_up=catch_up,
    )


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


def watch_event_to_bytes(
    joined: int, members: list[int] | None = None, ranks: int = 0, joiners: list[int] | None = None, donor: int = 0
) -> bytes:
    """A Watch stream's message: the watch is in place, or (elastic) the job's members changed."""
    event = pb.WatchEvent(joined=joined, members=members or [], ranks=ranks, joiners=joiners or [], donor=donor)
    return event.SerializeToString()


def state_request_from_bytes(data: bytes) -> pb.StateRequest:
    """Parse a serialized StateRequest.

    Raises:
        InvalidArgumentError: the bytes are not a StateRequest.
    """
    return _parse(data, pb.StateRequest)


def state_chunk_from_bytes(data: bytes) -> pb.StateChunk:
    """Parse a serialized StateChunk.

    Raises:
        InvalidArgumentError: the bytes are not a StateChunk.
    """
    return _parse(data, pb.StateChunk)


def state_chunk_to_bytes(sender: int, joiner: int, step: int, total_bytes: int, data: bytes) -> bytes:
    """One relayed chunk of the state, as the joiner receives it (every chunk carries the header)."""
    chunk = pb.StateChunk(rank=sender, joiner=joiner, step=step, total_bytes=total_bytes, data=data)
    return chunk.SerializeToString()


def put_state_response_to_bytes(relayed_bytes: int) -> bytes:
    """The answer to a complete PutState."""
    return pb.PutStateResponse(relayed_bytes=relayed_bytes).SerializeToString()


def _parse(data: bytes, message: type[M]) -> M:
    try:
        return message.FromString(data)
    except DecodeError as error:
        raise InvalidArgumentError(f"request is not a {message.DESCRIPTOR.full_name}: {error}") from None


def job_spec_of(request: pb.JoinRequest, rank: int) -> JobSpec:
    """A Join as one value (``rank``: its rank as the caller's credentials allow), checked field by field.

    Raises:
        InvalidArgumentError: naming the field, its value and what was expected.
    """
    try:
        role = MemberRole(request.role)
    except ValueError:
        raise InvalidArgumentError(
            f"role={request.role} is invalid; expected 0 (STARTING), 1 (JOINING) or 2 (RESUMING)"
        ) from None
    # By name: a field added to JobSpec and the proto is one line here, in no particular place.
    return JobSpec(
        job_id=request.job_id,
        rank=rank,
        world_size=request.world_size,
        incarnation=request.incarnation,
        ranks=request.ranks or 1,
        elastic=request.elastic,
        job_ranks=request.job_ranks,
        max_members=request.max_members,
        model_signature=request.model_signature,
        outer_step=outer_step_of(request),
        semi_sync=semi_sync_of(request),
        role=role,
        training_members=request.training_members,
        weighted=request.weighted,
    )


def outer_step_of(request: pb.JoinRequest) -> OuterStep | None:
    """A Join's outer step (DiLoCo on the aggregator), or None when it has none.

    Raises:
        InvalidArgumentError: naming the field, its value and what was expected.
    """
    if not request.HasField("outer_step"):
        return None
    given = request.outer_step
    try:
        return OuterStep(given.lr, given.momentum, given.nesterov)
    except ValueError as error:
        raise InvalidArgumentError(f"outer_step.{error}") from None


def semi_sync_of(request: pb.JoinRequest) -> SemiSync | None:
    """A Join's quorum and grace window (semi-synchronous rounds), or None for synchronous ones.

    Raises:
        InvalidArgumentError: naming the field, its value and what was expected.
    """
    if not request.HasField("semi_sync"):
        return None
    try:
        return SemiSync(request.semi_sync.quorum, request.semi_sync.grace_s)
    except ValueError as error:
        raise InvalidArgumentError(f"semi_sync.{error}") from None


@dataclass(frozen=True, slots=True)
class Seed:
    """A SeedOuter request, checked: one round key's global state as a member holds it before ``step``."""

    job_id: str
    rank: int
    incarnation: str
    step: int
    key: int
    keys: int
    parameters: np.ndarray
    momentum: np.ndarray | None


def seed_from_bytes(data: bytes) -> Seed:
    """Parse and check a serialized OuterSeed.

    Raises:
        InvalidArgumentError: not an OuterSeed, or its arrays are not whole float32 values of equal length.
    """
    request = _parse(data, pb.OuterSeed)
    arrays = []
    for name in ("parameters", "momentum"):
        raw = getattr(request, name)
        if len(raw) % 4:
            raise InvalidArgumentError(f"{name} holds {len(raw)} bytes; expected float32 values (a multiple of 4)")
        arrays.append(np.frombuffer(raw, dtype="<f4"))
    parameters, momentum = arrays
    if parameters.size == 0:
        raise InvalidArgumentError("parameters is empty; expected the round key's global parameters (float32)")
    return Seed(
        request.job_id,
        request.rank,
        request.incarnation,
        request.step,
        request.key,
        request.keys,
        parameters,
        momentum if momentum.size else None,
    )


def seeded_to_bytes(matched: bool, step: int, parameters: bytes = b"", momentum: bytes = b"") -> bytes:
    """The answer to a SeedOuter: matched, or the aggregator's copy to adopt."""
    return pb.OuterSeeded(matched=matched, step=step, parameters=parameters, momentum=momentum).SerializeToString()
