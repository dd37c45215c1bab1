"""The worker's side of the wire: requests out, responses in.

The only client module that builds or reads ``_pb2`` messages.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gradq.proto.convert import parse_with_tensor, serialize_with_tensor, tensor_from_proto
from gradq.proto.transport import REFUSAL_METADATA_KEY
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.wire import scalar_fields
from gradq.qcore import QuantizedArray
from gradq.qcore.outer_step import OuterStep

__all__ = [
    "PulledMean",
    "push_pull_request",
    "mean_from_bytes",
    "Refusal",
    "refusal_name",
    "refusal_of_metadata",
    "RoundKey",
    "StreamAnswer",
    "round_of_push",
    "stream_answer_of",
    "JobSpec",
    "join_request",
    "leave_request",
]

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
_PUSH_FIELDS = pb.PushPullRequest.DESCRIPTOR.fields_by_name
_STEP, _BUCKET, _INCARNATION = (_PUSH_FIELDS[name].number for name in ("step", "bucket", "incarnation"))
_ROUND_FIELDS = frozenset((_STEP, _BUCKET, _INCARNATION))


@dataclass(frozen=True, slots=True)
class PulledMean:
    """A round's answer as the worker sees it."""

    tensor: QuantizedArray  # the encoded mean; its arrays view the response bytes
    contributors: int
    partial: bool
    missing_ranks: tuple[int, ...]
    wire_bytes: int  # size of the encoded mean received
    skipped: bool = False  # a rank reported NaN/Inf: the values are zeros, skip the step


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a member says of its job in every Join, one value from the client's configuration to the wire.

    The aggregator checks it once against the job's (gradq.server.job_spec.JobSpec, its mirror); a new Join
    option is a field here, there and in the proto. A training loop writes its part alone
    (``JobSpec(model_signature=..., weighted=True)``) and ``GradqSession.connect`` fills in where the member
    sits (``world_size``, ``ranks``, ``elastic``, ``job_ranks``, ``max_members``).

    Raises:
        ValueError: at construction, a count out of range (world_size, ranks, job_ranks, max_members), naming
            it, its value and what was expected; the aggregator refuses any other bad field at the Join.
    """

    world_size: int = 1  # members the job starts with (its ranks, or its hosts under two-level aggregation)
    ranks: int = 1  # the job's ranks this member stands for
    elastic: bool = False
    job_ranks: int = 0  # the job's ranks in all (0: world_size, one per member, not checked)
    max_members: int = 0  # elastic: the most members at once (0: no cap of the job's own)
    model_signature: str = ""  # elastic: the host's model, one line per tensor ("": unchecked)
    outer_step: OuterStep | None = None  # DiLoCo: the outer step the aggregator runs (None: it only averages)
    semi_sync: tuple[int, float] | None = None  # (quorum, grace seconds) of a semi-synchronous round
    weighted: bool = False  # every push carries a weight, and the means are weighted by them

    def __post_init__(self) -> None:
        if not _is_integer(self.world_size) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} is invalid; expected an integer >= 1")
        if not _is_integer(self.ranks) or self.ranks < 1:
            raise ValueError(f"ranks={self.ranks!r} is invalid; expected an integer >= 1")
        if not _is_integer(self.job_ranks) or (self.job_ranks and self.job_ranks < self.world_size):
            raise ValueError(
                f"job_ranks={self.job_ranks!r} is invalid; expected an integer >= world_size={self.world_size} "
                f"(at least one rank per member) or 0 (world_size, one rank per member)"
            )
        if not _is_integer(self.max_members) or self.max_members < 0:
            raise ValueError(f"max_members={self.max_members!r} is invalid; expected an integer >= 0 (0: no cap)")
        for name in ("world_size", "ranks", "job_ranks", "max_members"):  # numpy's integers as Python's, for the wire
            object.__setattr__(self, name, int(getattr(self, name)))


def _is_integer(value: object) -> bool:
    """An integer (numpy's too) that is not a bool (True would pass for 1 member)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def join_request(
    job_id: str,
    rank: int,
    spec: JobSpec | int,
    incarnation: str = "",
    role: pb.MemberRole = pb.MEMBER_ROLE_STARTING,
    training_members: int = 0,
) -> pb.JoinRequest:
    """A Join for member ``rank`` of one run (``incarnation``) of the job ``spec`` describes.

    ``spec`` may be a bare world size (one rank per member, nothing else said); ``role`` (a proto
    MemberRole) says what an elastic member holds, and a RESUMING one how many members were
    training when it last heard (``training_members``; 0: unknown).
    """
    if isinstance(spec, int):
        spec = JobSpec(world_size=spec)
    outer, semi_sync = spec.outer_step, spec.semi_sync
    return pb.JoinRequest(
        job_id=job_id,
        rank=rank,
        world_size=spec.world_size,
        incarnation=incarnation,
        ranks=spec.ranks,
        elastic=spec.elastic,
        job_ranks=spec.job_ranks,
        max_members=spec.max_members,
        model_signature=spec.model_signature,
        outer_step=pb.OuterStep(lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov) if outer else None,
        semi_sync=pb.SemiSync(quorum=semi_sync[0], grace_s=semi_sync[1]) if semi_sync is not None else None,
        role=role,
        training_members=training_members,
        weighted=spec.weighted,
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


def watch_request(job_id: str, rank: int, incarnation: str = "", heartbeat_ms: int = 0) -> pb.WatchRequest:
    """A Watch for one member of one run (``incarnation``) of the job, promising a heartbeat every ``heartbeat_ms``
    (0: none)."""
    return pb.WatchRequest(job_id=job_id, rank=rank, incarnation=incarnation, heartbeat_ms=heartbeat_ms)


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
    weight: int = 0,
) -> bytes:
    """One serialized contribution to round (job, step, bucket); ``non_finite`` reports a NaN/Inf bucket.

    ``weight``: in a weighted job, what the push stands for (tokens, samples); 0 elsewhere.

    ``sequence`` names the push in its answer on a PushPullStream (PushPull ignores it); the push also
    says that its client takes an answer naming its round instead (``round_answers``, see ``StreamAnswer``),
    which lets the aggregator send every waiter of a round the same bytes.
    """
    request = pb.PushPullRequest(
        job_id=job_id,
        step=step,
        bucket=bucket,
        rank=rank,
        non_finite=non_finite,
        incarnation=incarnation,
        sequence=sequence,
        round_answers=True,
        weight=weight,
    )
    return serialize_with_tensor(request, "tensor", tensor)


# A round as a stream's answers and pushes name it: (step, bucket, incarnation).
RoundKey = tuple[int, int, str]


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    """What names a PushPullStream answer's push, and how the aggregator settled it.

    An answer names its push by ``sequence``; one with sequence 0 carries a
    round's mean and answers the oldest unanswered push of ``round`` (the
    aggregator writes all of a round's waiters the same bytes).
    """

    sequence: int
    code: grpc.StatusCode
    details: str
    refusal: Refusal  # why the push was refused (UNSPECIFIED when no reason was given)
    round: RoundKey


def stream_answer_of(data: bytes) -> StreamAnswer:
    """Read a PushPullStream answer's header; the mean is read by ``mean_from_bytes``.

    Raises:
        ValueError: the bytes are not a PushPullResponse.
    """
    try:
        response, _ = parse_with_tensor(data, pb.PushPullResponse, "mean")
    except DecodeError as error:
        raise ValueError(f"answer is not a gradq.v1.PushPullResponse: {error}") from None
    code = _STATUS_CODES.get(response.code, grpc.StatusCode.UNKNOWN)
    key = (response.step, response.bucket, response.incarnation)
    return StreamAnswer(response.sequence, code, response.details, refusal_name(response.refusal), key)


def round_of_push(request: bytes) -> RoundKey:
    """The round a serialized PushPullRequest pushes to, as its answer names it: (step, bucket, incarnation).

    Reads only the request's own fields: its tensor is skipped, not parsed.

    Raises:
        ValueError: the bytes are not a PushPullRequest.
    """
    try:
        fields = scalar_fields(request, _ROUND_FIELDS)
        step, bucket = fields.get(_STEP, 0), fields.get(_BUCKET, 0)
        incarnation = fields.get(_INCARNATION, b"")
        if not isinstance(step, int) or not isinstance(bucket, int) or not isinstance(incarnation, bytes):
            raise IndexError("a field of the wrong wire type")
        return step, bucket, incarnation.decode()
    except (IndexError, UnicodeDecodeError) as error:
        raise ValueError(f"request is not a gradq.v1.PushPullRequest: {error}") from None


class Refusal(str, enum.Enum):
    """Why the aggregator refused a call, as the client acts on it: the proto enum Refusal, by name.

    Each member is its name as a string (``Refusal.LOST == "LOST"``), as the
    aggregator sends it; UNSPECIFIED is "" (false): no reason to act on, read the
    status and details. Matches the proto both ways (tests/proto/test_contract.py).
    """

    UNSPECIFIED = ""
    UNKNOWN_JOB = "UNKNOWN_JOB"  # the job has no run there (e.g. the shard restarted): Join first
    NOT_JOINED = "NOT_JOINED"  # this member is not (or no longer) one of the run's
    PENDING = "PENDING"  # an elastic newcomer still waiting for the training state
    LOST = "LOST"  # a fixed job's rank counted lost: Join again
    LATE = "LATE"  # semi-synchronous: the round closed without this member
    ANOTHER_RUN = "ANOTHER_RUN"  # the call names another run than the job's there
    MODEL_MISMATCH = "MODEL_MISMATCH"  # this host's model is not the start quorum's
    BEHIND = "BEHIND"  # DiLoCo: the job's global state is past this host's outer round
    JOB_ENDED = "JOB_ENDED"  # the run this host resumes ended: its other hosts finished and left

    def __str__(self) -> str:
        return self.value

    @classmethod
    def named(cls, name: str) -> Refusal:
        """The refusal ``name`` names; UNSPECIFIED for "" or a name this client does not know (a newer aggregator's)."""
        try:
            return cls(name)
        except ValueError:
            return cls.UNSPECIFIED


def refusal_name(value: int) -> Refusal:
    """The refusal a proto Refusal value stands for; UNSPECIFIED for none or an unknown one."""
    if not value or value not in pb.Refusal.values():
        return Refusal.UNSPECIFIED
    return Refusal.named(pb.Refusal.Name(value).removeprefix("REFUSAL_"))


def refusal_of_metadata(metadata: Any) -> Refusal:
    """The refusal a call's trailing metadata names; UNSPECIFIED when it names none."""
    for key, value in metadata or ():
        if key == REFUSAL_METADATA_KEY:
            return Refusal.named(value if isinstance(value, str) else value.decode("ascii", "replace"))
    return Refusal.UNSPECIFIED


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
