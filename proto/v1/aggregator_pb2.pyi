from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Scheme(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEME_UNSPECIFIED: _ClassVar[Scheme]
    SCHEME_FLOAT32: _ClassVar[Scheme]
    SCHEME_FLOAT16: _ClassVar[Scheme]
    SCHEME_PER_TENSOR_AFFINE: _ClassVar[Scheme]
    SCHEME_PER_TENSOR_SYMMETRIC: _ClassVar[Scheme]
    SCHEME_PER_CHANNEL_AFFINE: _ClassVar[Scheme]
    SCHEME_PER_CHANNEL_SYMMETRIC: _ClassVar[Scheme]
    SCHEME_PER_CHANNEL_SIGN: _ClassVar[Scheme]
    SCHEME_SPARSE_TOPK: _ClassVar[Scheme]

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[Refusal]
    REFUSAL_UNKNOWN_JOB: _ClassVar[Refusal]
    REFUSAL_NOT_JOINED: _ClassVar[Refusal]
    REFUSAL_PENDING: _ClassVar[Refusal]
    REFUSAL_LOST: _ClassVar[Refusal]
    REFUSAL_LATE: _ClassVar[Refusal]
    REFUSAL_ANOTHER_RUN: _ClassVar[Refusal]
    REFUSAL_MODEL_MISMATCH: _ClassVar[Refusal]
    REFUSAL_BEHIND: _ClassVar[Refusal]
    REFUSAL_JOB_ENDED: _ClassVar[Refusal]

class MemberRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_ROLE_STARTING: _ClassVar[MemberRole]
    MEMBER_ROLE_JOINING: _ClassVar[MemberRole]
    MEMBER_ROLE_RESUMING: _ClassVar[MemberRole]
SCHEME_UNSPECIFIED: Scheme
SCHEME_FLOAT32: Scheme
SCHEME_FLOAT16: Scheme
SCHEME_PER_TENSOR_AFFINE: Scheme
SCHEME_PER_TENSOR_SYMMETRIC: Scheme
SCHEME_PER_CHANNEL_AFFINE: Scheme
SCHEME_PER_CHANNEL_SYMMETRIC: Scheme
SCHEME_PER_CHANNEL_SIGN: Scheme
SCHEME_SPARSE_TOPK: Scheme
REFUSAL_UNSPECIFIED: Refusal
REFUSAL_UNKNOWN_JOB: Refusal
REFUSAL_NOT_JOINED: Refusal
REFUSAL_PENDING: Refusal
REFUSAL_LOST: Refusal
REFUSAL_LATE: Refusal
REFUSAL_ANOTHER_RUN: Refusal
REFUSAL_MODEL_MISMATCH: Refusal
REFUSAL_BEHIND: Refusal
REFUSAL_JOB_ENDED: Refusal
MEMBER_ROLE_STARTING: MemberRole
MEMBER_ROLE_JOINING: MemberRole
MEMBER_ROLE_RESUMING: MemberRole

class QuantizedTensor(_message.Message):
    __slots__ = ("scheme", "bits", "numel", "channel_size", "scale", "zero_point", "payload", "dtype", "topk")
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ZERO_POINT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    scheme: Scheme
    bits: int
    numel: int
    channel_size: int
    scale: bytes
    zero_point: bytes
    payload: bytes
    dtype: str
    topk: int
    def __init__(self, scheme: _Optional[_Union[Scheme, str]] = ..., bits: _Optional[int] = ..., numel: _Optional[int] = ..., channel_size: _Optional[int] = ..., scale: _Optional[bytes] = ..., zero_point: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., dtype: _Optional[str] = ..., topk: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "incarnation", "ranks", "elastic", "job_ranks", "max_members", "model_signature", "outer_step", "semi_sync", "role", "training_members", "weighted")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    JOB_RANKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    SEMI_SYNC_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TRAINING_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    incarnation: str
    ranks: int
    elastic: bool
    job_ranks: int
    max_members: int
    model_signature: str
    outer_step: OuterStep
    semi_sync: SemiSync
    role: MemberRole
    training_members: int
    weighted: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., incarnation: _Optional[str] = ..., ranks: _Optional[int] = ..., elastic: _Optional[bool] = ..., job_ranks: _Optional[int] = ..., max_members: _Optional[int] = ..., model_signature: _Optional[str] = ..., outer_step: _Optional[_Union[OuterStep, _Mapping]] = ..., semi_sync: _Optional[_Union[SemiSync, _Mapping]] = ..., role: _Optional[_Union[MemberRole, str]] = ..., training_members: _Optional[int] = ..., weighted: _Optional[bool] = ...) -> None: ...

class SemiSync(_message.Message):
    __slots__ = ("quorum", "grace_s")
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    quorum: int
    grace_s: float
    def __init__(self, quorum: _Optional[int] = ..., grace_s: _Optional[float] = ...) -> None: ...

class OuterStep(_message.Message):
    __slots__ = ("lr", "momentum", "nesterov")
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    lr: float
    momentum: float
    nesterov: bool
    def __init__(self, lr: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("world_size", "server_id", "joined", "rank", "incarnation", "catch_up")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    server_id: str
    joined: int
    rank: int
    incarnation: str
    catch_up: bool
    def __init__(self, world_size: _Optional[int] = ..., server_id: _Optional[str] = ..., joined: _Optional[int] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., catch_up: _Optional[bool] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("job_id", "step", "bucket", "rank", "tensor", "non_finite", "incarnation", "sequence", "round_answers", "weight")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    bucket: int
    rank: int
    tensor: QuantizedTensor
    non_finite: bool
    incarnation: str
    sequence: int
    round_answers: bool
    weight: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., bucket: _Optional[int] = ..., rank: _Optional[int] = ..., tensor: _Optional[_Union[QuantizedTensor, _Mapping]] = ..., non_finite: _Optional[bool] = ..., incarnation: _Optional[str] = ..., sequence: _Optional[int] = ..., round_answers: _Optional[bool] = ..., weight: _Optional[int] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("mean", "contributors", "partial", "missing_ranks", "skipped", "sequence", "code", "details", "refusal", "step", "bucket", "incarnation")
    MEAN_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    mean: QuantizedTensor
    contributors: int
    partial: bool
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    skipped: bool
    sequence: int
    code: int
    details: str
    refusal: Refusal
    step: int
    bucket: int
    incarnation: str
    def __init__(self, mean: _Optional[_Union[QuantizedTensor, _Mapping]] = ..., contributors: _Optional[int] = ..., partial: _Optional[bool] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., skipped: _Optional[bool] = ..., sequence: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., refusal: _Optional[_Union[Refusal, str]] = ..., step: _Optional[int] = ..., bucket: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job_id", "rank", "incarnation", "heartbeat_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    incarnation: str
    heartbeat_ms: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("joined", "members", "ranks", "joiners", "donor")
    JOINED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    JOINERS_FIELD_NUMBER: _ClassVar[int]
    DONOR_FIELD_NUMBER: _ClassVar[int]
    joined: int
    members: _containers.RepeatedScalarFieldContainer[int]
    ranks: int
    joiners: _containers.RepeatedScalarFieldContainer[int]
    donor: int
    def __init__(self, joined: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., ranks: _Optional[int] = ..., joiners: _Optional[_Iterable[int]] = ..., donor: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job_id", "rank", "incarnation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    incarnation: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("job_id", "rank", "incarnation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    incarnation: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("job_id", "rank", "incarnation", "joiner", "step", "total_bytes", "data")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    JOINER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    incarnation: str
    joiner: int
    step: int
    total_bytes: int
    data: bytes
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., joiner: _Optional[int] = ..., step: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutStateResponse(_message.Message):
    __slots__ = ("relayed_bytes",)
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    relayed_bytes: int
    def __init__(self, relayed_bytes: _Optional[int] = ...) -> None: ...

class OuterSeed(_message.Message):
    __slots__ = ("job_id", "rank", "incarnation", "step", "key", "keys", "parameters", "momentum")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    incarnation: str
    step: int
    key: int
    keys: int
    parameters: bytes
    momentum: bytes
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., step: _Optional[int] = ..., key: _Optional[int] = ..., keys: _Optional[int] = ..., parameters: _Optional[bytes] = ..., momentum: _Optional[bytes] = ...) -> None: ...

class OuterSeeded(_message.Message):
    __slots__ = ("matched", "step", "parameters", "momentum")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    matched: bool
    step: int
    parameters: bytes
    momentum: bytes
    def __init__(self, matched: _Optional[bool] = ..., step: _Optional[int] = ..., parameters: _Optional[bytes] = ..., momentum: _Optional[bytes] = ...) -> None: ...

class ShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardsResponse(_message.Message):
    __slots__ = ("addresses",)
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addresses: _Optional[_Iterable[str]] = ...) -> None: ...
