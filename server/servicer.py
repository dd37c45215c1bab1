"""AggregatorServicer: decode, call the round logic, map its errors to gRPC statuses."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.server import serde
from gradq.server.errors import RoundError
from gradq.server.rounds import RoundTable

__all__ = ["AggregatorServicer"]

T = TypeVar("T")


class AggregatorServicer(pb_grpc.AggregatorServicer):
    """Thin: every method is decode -> RoundTable -> encode."""

    def __init__(self, table: RoundTable) -> None:
        self.table = table
        # Lets clients notice an aggregator restart (their rounds were lost).
        self.server_id = uuid.uuid4().hex

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:  # noqa: N802
        world_size, joined = _call(context, lambda: self.table.join(request.job_id, request.rank, request.world_size))
        return serde.join_to_proto(world_size, joined, self.server_id)

    def PushPull(self, request: pb.PushPullRequest, context: grpc.ServicerContext) -> pb.PushPullResponse:  # noqa: N802
        contribution = _call(context, lambda: serde.contribution_from_proto(request))
        result = _call(
            context,
            lambda: self.table.contribute(
                contribution.job_id, contribution.step, contribution.bucket, contribution.rank, contribution.tensor
            ),
        )
        return serde.result_to_proto(result)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:  # noqa: N802
        _call(context, lambda: self.table.leave(request.job_id, request.rank))
        return pb.LeaveResponse()


def _call(context: grpc.ServicerContext, action: Callable[[], T]) -> T:
    try:
        return action()
    except RoundError as error:
        _abort(context, error)


def _abort(context: grpc.ServicerContext, error: RoundError) -> NoReturn:
    context.abort(grpc.StatusCode[error.code], str(error))
    raise AssertionError("context.abort returned")  # abort always raises
