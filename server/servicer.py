"""AggregatorServicer: decode, call the round logic, map its errors to gRPC statuses.

The methods are registered by hand (``add_aggregator_to_server``) rather than
through the generated helper, for two savings measured in
bench/server_throughput.py: the request arrives as raw bytes and is dropped
once it is in the accumulator (a waiting handler holds no payload), and the
response is serialized once per round, not once per waiting rank. Raw bytes
also let every method answer malformed input with INVALID_ARGUMENT (gRPC's
own deserializer would answer INTERNAL and log a traceback). A test checks
that every RPC of the .proto has a handler here.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.server import serde
from gradq.server.auth import check_scope
from gradq.server.errors import RoundError
from gradq.server.rounds import RoundResult, RoundTable
from gradq.server.waiting import WaitingCalls, peer_host

__all__ = ["AggregatorServicer", "add_aggregator_to_server", "aggregator_handlers", "SERVICE_NAME"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name

T = TypeVar("T")

_DEADLINE_MARGIN_S = 0.5


class RawRequest:
    """A request's undecoded bytes; the handler parses them and lets them go."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def take(self) -> bytes:
        data, self.data = self.data, b""
        return data


class AggregatorServicer:
    """Thin: every method is decode -> RoundTable -> encode.

    Args:
        table: the round logic.
        waiting: caps on PushPull calls waiting for their rounds.
    """

    def __init__(self, table: RoundTable, waiting: WaitingCalls) -> None:
        self.table = table
        self.waiting = waiting
        # Lets clients notice an aggregator restart (their rounds were lost).
        self.server_id = uuid.uuid4().hex

    def Join(self, raw: RawRequest, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        request = _call(context, serde.join_from_bytes, raw.take())
        _call(context, check_scope, request.job_id, request.rank)
        world_size, joined = _call(
            context, self.table.join, request.job_id, request.rank, request.world_size, request.incarnation
        )
        return serde.join_to_proto(world_size, joined, self.server_id).SerializeToString()

    def PushPull(self, raw: RawRequest, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        contribution = _call(context, serde.contribution_from_bytes, raw.take())
        job_id = contribution.job_id
        _call(context, check_scope, job_id, contribution.rank)
        peer = peer_host(context.peer())
        _call(context, self.waiting.acquire, job_id, peer)
        try:
            ticket = _call(
                context,
                self.table.push,
                job_id,
                contribution.step,
                contribution.bucket,
                contribution.rank,
                contribution.tensor,
                contribution.non_finite,
                contribution.incarnation,
            )
            del contribution  # accumulated: nothing of the payload need outlive the push
            # Set when the client cancels or its deadline passes, so the wait ends and frees its thread.
            gone = threading.Event()
            if not context.add_callback(gone.set):
                gone.set()
            remaining = context.time_remaining()
            # gRPC cancels the call (setting ``gone``) when the client's deadline passes; the margin
            # only backs that up, so the client sees its own DEADLINE_EXCEEDED, not our CANCELLED.
            patience = None if remaining is None else remaining + _DEADLINE_MARGIN_S
            result = _call(context, self.table.wait, ticket, gone, patience)
        finally:
            self.waiting.release(job_id, peer)
        assert isinstance(result.packaged, bytes), "the table packages every result"
        return result.packaged

    def Leave(self, raw: RawRequest, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        request = _call(context, serde.leave_from_bytes, raw.take())
        _call(context, check_scope, request.job_id, request.rank)
        _call(context, self.table.leave, request.job_id, request.rank, request.incarnation)
        return pb.LeaveResponse().SerializeToString()


def package_result(result: RoundResult) -> bytes:
    """The serialized PushPullResponse for a finished round (the table calls this once)."""
    return serde.result_to_bytes(result)


def _as_bytes(response: bytes) -> bytes:
    return response


def aggregator_handlers(servicer: AggregatorServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Method name -> handler for every RPC of the Aggregator service; each takes and returns raw bytes."""
    return {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=RawRequest, response_serializer=_as_bytes
        )
        for name in ("Join", "PushPull", "Leave")
    }


def add_aggregator_to_server(servicer: AggregatorServicer, server: grpc.Server) -> None:
    """Register the Aggregator service's methods on ``server``."""
    handlers = aggregator_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _call(context: grpc.ServicerContext, action: Callable[..., T], *args: object) -> T:
    try:
        return action(*args)
    except RoundError as error:
        _abort(context, error)


def _abort(context: grpc.ServicerContext, error: RoundError) -> NoReturn:
    context.abort(grpc.StatusCode[error.code], str(error))
    raise AssertionError("context.abort returned")  # abort always raises
