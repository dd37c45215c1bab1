"""The worker's side of the wire: requests out, responses in.

The only client module that builds or reads ``_pb2`` messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gradq.proto.convert import parse_with_tensor, serialize_with_tensor, tensor_from_proto
from gradq.proto.transport import REFUSAL_METADATA_KEY
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantizedArray
from gradq.qcore.outer_step import OuterStep

__all__ = [
    "PulledMean",
    "push_pull_request",
    "mean_from_bytes",
    "refusal_name",
    "refusal_of_metadata",
    "stream_answer_of",
    "join_request",
    "leave_request",
]

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class PulledMean:
    """A round's answer as the worker sees it."""

    tensor: QuantizedArray  # the encoded mean; its arrays view the response bytes
    contributors: int
    partial: bool
    missing_ranks: tuple[int, ...]
    wire_bytes: int  # size of the encoded mean received
    skipped: bool = False  # a rank reported NaN/Inf: the values are zeros, skip the step


def join_request(
    job_id: str,
    rank: int,
    world_size: int,
    incarnation: str = "",
    ranks: int = 1,
    elastic: bool = False,
    job_ranks: int = 0,
    max_members: int = 0,
    model_signature: str = "",
    outer_step: OuterStep | None = None,
    semi_sync: tuple[int, float] | None = None,
    role: pb.MemberRole = pb.MEMBER_ROLE_STARTING,
) -> pb.JoinRequest:
    """A Join for one member of one run (``incarnation``) of the job, standing for ``ranks`` of its ``job_ranks``.

    ``job_ranks`` 0 says the job has ``world_size`` ranks, one per member;
    ``max_members`` 0 puts no cap of its own on an elastic job's members;
    ``model_signature`` "" leaves the host's model unchecked; ``outer_step`` has
    the aggregator keep a DiLoCo job's global state (None: it only averages);
    ``semi_sync`` (quorum, grace seconds) makes its rounds semi-synchronous;
    ``role`` (a proto MemberRole) says what an elastic member holds.
    """
    outer = None
    if outer_step is not None:
        outer = pb.OuterStep(lr=outer_step.lr, momentum=outer_step.momentum, nesterov=outer_step.nesterov)
    return pb.JoinRequest(
        job_id=job_id,
        rank=rank,
        world_size=world_size,
        incarnation=incarnation,
        ranks=ranks,
        elastic=elastic,
        job_ranks=job_ranks,
        max_members=max_members,
        model_signature=model_signature,
        outer_step=outer,
        semi_sync=pb.SemiSync(quorum=semi_sync[0], grace_s=semi_sync[1]) if semi_sync is not None else None,
        role=role,
    )


def outer_seed(
    job_id: str, rank: int, incarnation: str, step: int, key: int, keys: int, parameters: bytes, momentum: bytes
) -> pb.OuterSeed:
    """A SeedOuter: one round key's DiLoCo global state (float32 LE bytes) as this member holds it before ``step``."""
    return pb.OuterSeed(
        job_id=job_id,
        rank=rank,
        incarnation=incarnation,
        step=step,
        key=key,
        keys=keys,
        parameters=parameters,
        momentum=momentum,
    )


def state_request(job_id: str, rank: int, incarnation: str) -> pb.StateRequest:
    """A pending elastic member's request for the training state."""
    return pb.StateRequest(job_id=job_id, rank=rank, incarnation=incarnation)


def state_chunk(
    job_id: str, rank: int, incarnation: str, joiner: int, step: int, total_bytes: int, data: bytes
) -> pb.StateChunk:
    """One chunk of the training state a member sends ``joiner``."""
    return pb.StateChunk(
        job_id=job_id,
        rank=rank,
        incarnation=incarnation,
        joiner=joiner,
        step=step,
        total_bytes=total_bytes,
        data=data,
    )


def watch_request(job_id: str, rank: int, incarnation: str = "") -> pb.WatchRequest:
    """A Watch for one member of one run (``incarnation``) of the job."""
    return pb.WatchRequest(job_id=job_id, rank=rank, incarnation=incarnation)


def leave_request(job_id: str, rank: int, incarnation: str = "") -> pb.LeaveRequest:
    """A Leave for one rank of one run (``incarnation``) of the job."""
    return pb.LeaveRequest(job_id=job_id, rank=rank, incarnation=incarnation)


def push_pull_request(
    job_id: str,
    step: int,
    bucket: int,
    rank: int,
    tensor: QuantizedArray,
    non_finite: bool = False,
    incarnation: str = "",
    sequence: int = 0,
) -> bytes:
    """One serialized contribution to round (job, step, bucket); ``non_finite`` reports a NaN/Inf bucket.

    ``sequence`` names the push in its answer on a PushPullStream (PushPull ignores it).
    """
    request = pb.PushPullRequest(
        job_id=job_id,
        step=step,
        bucket=bucket,
        rank=rank,
        non_finite=non_finite,
        incarnation=incarnation,
        sequence=sequence,
    )
    return serialize_with_tensor(request, "tensor", tensor)


def stream_answer_of(data: bytes) -> tuple[int, grpc.StatusCode, str, str]:
    """(sequence, status, details, refusal) of a PushPullStream answer; the mean is read by ``mean_from_bytes``.

    The refusal is the reason's name (``"NOT_JOINED"``, see ``refusal_name``), "" when none was given.

    Raises:
        ValueError: the bytes are not a PushPullResponse.
    """
    try:
        response, _ = parse_with_tensor(data, pb.PushPullResponse, "mean")
    except DecodeError as error:
        raise ValueError(f"answer is not a gradq.v1.PushPullResponse: {error}") from None
    code = _STATUS_CODES.get(response.code, grpc.StatusCode.UNKNOWN)
    return response.sequence, code, response.details, refusal_name(response.refusal)


def refusal_name(value: int) -> str:
    """The name of a proto Refusal value without its prefix (``"NOT_JOINED"``); "" for none or an unknown one."""
    if not value or value not in pb.Refusal.values():
        return ""
    return pb.Refusal.Name(value).removeprefix("REFUSAL_")


def refusal_of_metadata(metadata: Any) -> str:
    """The refusal a call's trailing metadata names (``"NOT_JOINED"``), "" when it names none."""
    for key, value in metadata or ():
        if key == REFUSAL_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return ""


def mean_from_bytes(data: bytes, numel: int) -> PulledMean:
    """Parse and check the PushPullResponse the aggregator sent back for a push of ``numel`` elements.

    Raises:
        ValueError: the response is malformed or the mean has a different element count than was pushed.
    """
    try:
        response, payload = parse_with_tensor(data, pb.PushPullResponse, "mean")
    except DecodeError as error:
        raise ValueError(f"response is not a gradq.v1.PushPullResponse: {error}") from None
    mean = tensor_from_proto(response.mean, "mean", payload)
    if mean.numel != numel:
        raise ValueError(f"mean.numel={mean.numel} does not match the {numel} elements pushed")
    return PulledMean(
        tensor=mean,
        contributors=response.contributors,
        partial=response.partial,
        missing_ranks=tuple(response.missing_ranks),
        wire_bytes=mean.nbytes,
        skipped=response.skipped,
    )
