"""AggregatorServicer: decode, call the round logic, map its errors to gRPC statuses.

PushPull is registered by hand (``add_aggregator_to_server``) rather than
through the generated helper, for two savings measured in
bench/server_throughput.py: the request arrives as raw bytes and is dropped
once it is in the accumulator (a waiting handler holds no payload), and the
response is serialized once per round, not once per waiting rank.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.server import serde
from gradq.server.auth import check_rank
from gradq.server.errors import RoundError
from gradq.server.rounds import RoundResult, RoundTable

__all__ = ["AggregatorServicer", "add_aggregator_to_server", "SERVICE_NAME"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name

T = TypeVar("T")


class RawRequest:
    """A request's undecoded bytes; the handler parses them and lets them go."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def take(self) -> bytes:
        data, self.data = self.data, b""
        return data


class AggregatorServicer:
    """Thin: every method is decode -> RoundTable -> encode."""

    def __init__(self, table: RoundTable) -> None:
        self.table = table
        # Lets clients notice an aggregator restart (their rounds were lost).
        self.server_id = uuid.uuid4().hex

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:  # noqa: N802
        _call(context, check_rank, request.rank)
        world_size, joined = _call(context, self.table.join, request.job_id, request.rank, request.world_size)
        return serde.join_to_proto(world_size, joined, self.server_id)

    def PushPull(self, raw: RawRequest, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        contribution = _call(context, serde.contribution_from_bytes, raw.take())
        _call(context, check_rank, contribution.rank)
        ticket = _call(
            context,
            self.table.push,
            contribution.job_id,
            contribution.step,
            contribution.bucket,
            contribution.rank,
            contribution.tensor,
            contribution.non_finite,
        )
        del contribution  # accumulated: nothing of the payload need outlive the push
        result = _call(context, self.table.wait, ticket)
        assert isinstance(result.packaged, bytes), "the table packages every result"
        return result.packaged

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:  # noqa: N802
        _call(context, check_rank, request.rank)
        _call(context, self.table.leave, request.job_id, request.rank)
        return pb.LeaveResponse()


def package_result(result: RoundResult) -> bytes:
    """The serialized PushPullResponse for a finished round (the table calls this once)."""
    return serde.result_to_bytes(result)


def _as_bytes(response: bytes) -> bytes:
    return response


def add_aggregator_to_server(servicer: AggregatorServicer, server: grpc.Server) -> None:
    """Register the Aggregator service's three methods on ``server``."""
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            servicer.Join,
            request_deserializer=pb.JoinRequest.FromString,
            response_serializer=pb.JoinResponse.SerializeToString,
        ),
        "PushPull": grpc.unary_unary_rpc_method_handler(
            servicer.PushPull, request_deserializer=RawRequest, response_serializer=_as_bytes
        ),
        "Leave": grpc.unary_unary_rpc_method_handler(
            servicer.Leave,
            request_deserializer=pb.LeaveRequest.FromString,
            response_serializer=pb.LeaveResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _call(context: grpc.ServicerContext, action: Callable[..., T], *args: object) -> T:
    try:
        return action(*args)
    except RoundError as error:
        _abort(context, error)


def _abort(context: grpc.ServicerContext, error: RoundError) -> NoReturn:
    context.abort(grpc.StatusCode[error.code], str(error))
    raise AssertionError("context.abort returned")  # abort always raises
