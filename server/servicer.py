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

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import NoReturn, TypeVar

import grpc

from gradq.proto.transport import REFUSAL_METADATA_KEY, bounded_details
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.server import outer_service, serde
from gradq.server.auth import check_scope, scoped_rank
from gradq.server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    Refusal,
    RoundError,
    UnavailableError,
)
from gradq.server.job import Job
from gradq.server.job_spec import JobSpec
from gradq.server.liveness import LOST_REASON, Heartbeats, Liveness
from gradq.server.membership import ANY_RANK
from gradq.server.outer_service import OuterJoiners
from gradq.server.push_streams import PushStreams
from gradq.server.rounds import JoinAnswer, RoundResult, RoundTable
from gradq.server.state_relay import StateHeader, StateRelays
from gradq.server.waiting import WaitingCalls, peer_host

__all__ = ["AggregatorServicer", "add_aggregator_to_server", "aggregator_handlers", "SERVICE_NAME"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a Join whose model disagrees with another host's waits for the start quorum to decide, at most
# (see AggregatorServicer._await_model).
_MODEL_WAIT_S = 60.0
# How often the Watch streams' heartbeats are checked: a late one is found at most this much past its limit.
_HEARTBEAT_CHECK_S = 0.1


class RawRequest:
    """A request's undecoded bytes; the handler parses them and lets them go."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def take(self) -> bytes:
        data, self.data = self.data, b""
        return data


class AggregatorServicer:
    """Thin: every method is decode -> plain logic -> encode, on grpc.aio's event loop.

    A push, alone or on a stream, goes to ``pushes`` (gradq.server.push_streams:
    what runs on the loop and what on the pool, and the wait for its round as a
    coroutine, no thread). Other work that may wait for a round's lock or run
    long (joining, leaving, seeding DiLoCo's state) runs on the loop's default
    executor, a small thread pool; ``asyncio.to_thread`` carries the call's
    token scope into it. A Join held for its job's model vote, a Watch and a
    state transfer wait as coroutines too.

    Args:
        table: the round logic.
        waiting: caps on pushes waiting for their rounds.
        liveness: the Watch streams, whose unannounced end loses a rank.
        membership_observer: told (job id, event, members training) on every
            change of an elastic job's members (the metrics); from any thread.
    """

    def __init__(
        self,
        table: RoundTable,
        waiting: WaitingCalls,
        liveness: Liveness,
        membership_observer: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.table = table
        self.waiting = waiting
        self.liveness = liveness
        self.relays = StateRelays(table, self.membership_changed)
        self.outer_joiners = OuterJoiners(table, self.relays)
        self._observe_membership = membership_observer
        self.pushes = PushStreams(table, waiting)
        # Set when the server stops: every Watch ends (OK) rather than holding the stop for its grace.
        self._stopping = asyncio.Event()
        # Each elastic job's open Watch streams, woken to send its members whenever they change.
        self._watchers: dict[Job, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, known from the first Watch
        # The Watch streams' heartbeats, checked together on the loop (a late one is found within this period).
        self._heartbeats = Heartbeats(_HEARTBEAT_CHECK_S, time.monotonic)
        # Joins waiting for their job's start quorum to decide its model, by job id: woken when its vote may have
        # changed (``model_vote_changed``). Touched on the loop only; the loop is known from the first.
        self._model_waits: dict[str, set[asyncio.Event]] = {}
        self._model_loop: asyncio.AbstractEventLoop | None = None
        # Lets clients notice an aggregator restart (their rounds were lost).
        self.server_id = uuid.uuid4().hex
        table.listen(self)  # the table's news (TableEvents): last, once everything it may touch is made

    async def Join(self, raw: RawRequest, context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        request = await _call(context, serde.join_from_bytes, raw.take())
        rank = scoped_rank(request.rank, ANY_RANK)
        await _call(context, check_scope, request.job_id, rank)
        spec = await _call(context, serde.job_spec_of, request, rank)
        answer = await _in_pool(context, self.table.join, spec, peer_host(context.peer()))
        if answer.model_undecided:
            await self._await_model(context, spec, answer)
        response = serde.join_to_proto(
            answer.world_size, answer.joined, self.server_id, answer.rank, answer.incarnation, answer.catch_up
        )
        return response.SerializeToString()

    async def _await_model(self, context: grpc.aio.ServicerContext, spec: JobSpec, answer: JoinAnswer) -> None:
        """Hold a Join whose model disagrees with another starting host's until a majority decides.

        The job's model is its start quorum's, not the fastest host's: this Join is answered once the
        disagreement is settled (its model won: it trains; it lost: MODEL_MISMATCH, naming the tensor), or
        refused when its deadline (at most ``_MODEL_WAIT_S``) passes first. A waiting Join is one coroutine,
        no thread: it looks again whenever the table says the job's vote may have changed (a Join, a Leave, a
        loss, a waiting Join given up, the run retired), and only then.
        """
        loop = asyncio.get_running_loop()
        self._model_loop = loop
        remaining = context.time_remaining()
        limit = _MODEL_WAIT_S if remaining is None else min(_MODEL_WAIT_S, max(remaining - 0.5, 0.0))
        give_up = loop.time() + limit
        changed = asyncio.Event()
        waits = self._model_waits.setdefault(spec.job_id, set())
        waits.add(changed)
        try:
            while True:
                changed.clear()  # before looking: a change from now on wakes the wait below
                if await _call(context, self.table.vote.decided, spec.job_id, answer.rank, answer.incarnation):
                    return
                left = give_up - loop.time()
                if left <= 0:
                    raise FailedPreconditionError(
                        f"the hosts that joined elastic job {spec.job_id!r} disagree on the model and no majority of "
                        f"the {spec.world_size} it starts with has settled which is the job's within {limit:.0f} s; "
                        f"start the hosts with one model",
                        Refusal.MODEL_MISMATCH,
                    )
                with contextlib.suppress(asyncio.TimeoutError):  # (not the builtin before Python 3.11)
                    await asyncio.wait_for(changed.wait(), left)
        except (RoundError, asyncio.CancelledError) as error:
            self.table.vote.give_up(spec.job_id, answer.rank, answer.incarnation)
            if isinstance(error, RoundError):
                await _abort(context, error)
            raise
        finally:
            waits.discard(changed)
            if not waits and self._model_waits.get(spec.job_id) is waits:
                del self._model_waits[spec.job_id]

    def model_vote_changed(self, job_id: str) -> None:
        """The start quorum's vote of ``job_id`` may have changed (from any thread): its waiting Joins look again."""
        loop = self._model_loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the server has stopped
                loop.call_soon_threadsafe(self._wake_model_waits, job_id)

    def _wake_model_waits(self, job_id: str) -> None:
        for changed in self._model_waits.get(job_id, ()):
            changed.set()

    async def PushPull(self, raw: RawRequest, context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        peer = peer_host(context.peer())
        slot: list[tuple[str, str]] = []  # the push's waiting slot, once it is in its round
        try:
            return await self.pushes.push(raw.take(), peer, slot.append)
        except RoundError as error:
            await _abort(context, error)
        finally:
            for held in slot:  # a unary call's answer is written as the handler returns
                self.waiting.release(*held)

    async def PushPullStream(  # noqa: N802
        self, requests: AsyncIterator[RawRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """PushPull's pushes as one stream's messages, each answered as its round finishes (``PushStreams.serve``)."""
        try:
            # Closed with this call, however it ends: the stream's pushes and waiting slots are given back at once.
            async with contextlib.aclosing(self.pushes.serve(requests, peer_host(context.peer()))) as answers:
                async for answer in answers:
                    yield answer
        except RoundError as error:
            await _abort(context, error)

    async def Watch(  # noqa: N802
        self, requests: AsyncIterator[RawRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Stay open while the rank lives: a parked coroutine, no thread; its end without a Leave loses the rank,
        and so does a promised heartbeat late by more than --keepalive-timeout, or sent far more often than
        promised (gradq.server.liveness)."""
        heard = requests.__aiter__()
        try:
            raw = await heard.__anext__()
        except StopAsyncIteration:
            await _abort(context, InvalidArgumentError("the Watch stream sent no WatchRequest; expected one first"))
        request = await _call(context, serde.watch_from_bytes, raw.take())
        await _call(context, check_scope, request.job_id, request.rank)
        silence_s = await _call(context, self.liveness.silence_limit, request.heartbeat_ms)
        watch = await _call(context, self.liveness.open, request.job_id, request.rank, request.incarnation)
        loop = self._loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        heartbeat = (
            self._heartbeats.add(request.heartbeat_ms / 1000, silence_s, changed) if silence_s is not None else None
        )
        # Ended with the call; a client that half-closes has stopped its heartbeats and falls silent.
        listening = loop.create_task(heartbeat.listen(heard)) if heartbeat is not None else None
        self._watchers.setdefault(watch.job, set()).add(changed)
        reason = LOST_REASON
        try:
            yield self._watch_event(watch.job)
            # Until the server stops, gRPC cancels the call (the client went) or the client breaks its heartbeat
            # promise (late, or flooding); an elastic job's membership changes meanwhile are sent on, coalesced.
            while not self._stopping.is_set():
                broken = heartbeat.broken(request.heartbeat_ms, self.liveness.late_after_s) if heartbeat else None
                if broken is not None:
                    reason = str(broken)
                    await _abort(context, type(broken)(f"rank {request.rank}: {reason}"))
                await changed.wait()
                changed.clear()
                if not self._stopping.is_set() and not (heartbeat is not None and heartbeat.broken_off):
                    yield self._watch_event(watch.job)
        finally:
            if heartbeat is not None:
                self._heartbeats.discard(heartbeat)
            if listening is not None:
                listening.cancel()
            watchers = self._watchers.get(watch.job, set())
            watchers.discard(changed)
            if not watchers:
                self._watchers.pop(watch.job, None)
            # Not awaited: the call is being cancelled. Closing rounds takes their locks, so off the loop.
            asyncio.get_running_loop().run_in_executor(None, self.liveness.close, watch, reason)

    def _watch_event(self, job: Job) -> bytes:
        """What a Watch sends now: how many joined, and for an elastic job who trains and who waits."""
        with self.table.jobs.lock:
            members = sorted(job.members.joined)
            ranks, donor, elastic = job.members.ranks_training(), job.members.donor(), job.members.elastic
        if not elastic:
            return serde.watch_event_to_bytes(len(members))
        return serde.watch_event_to_bytes(len(members), members, ranks, self.relays.waiting(job), donor)

    def membership_changed(self, job: Job, event: str) -> None:
        """An elastic job's members changed (from any thread): count it, and wake its Watch streams to send it."""
        if self._observe_membership is not None:
            with self.table.jobs.lock:
                members = len(job.members.joined)
            self._observe_membership(job.job_id, event, members)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the server has stopped
                self._loop.call_soon_threadsafe(self._wake_watchers, job)

    def _wake_watchers(self, job: Job) -> None:
        self.relays.fail_unserved(job)
        for changed in self._watchers.get(job, ()):
            changed.set()

    async def end_watches(self) -> None:
        """End every Watch stream (the server is stopping: no rank is lost by it), and each PushPullStream once idle."""
        self._stopping.set()
        self._heartbeats.stop()
        for watchers in self._watchers.values():
            for changed in watchers:
                changed.set()
        self.pushes.stop()

    async def FetchState(self, raw: RawRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:  # noqa: N802
        """A pending elastic member waits for the training state, and receives it as a live member sends it."""
        request = await _call(context, serde.state_request_from_bytes, raw.take())
        await _call(context, check_scope, request.job_id, request.rank)
        relay = await _call(context, self.relays.open, request.job_id, request.rank, request.incarnation)
        try:
            async for data in relay.chunks():
                header = relay.header
                assert header is not None
                yield serde.state_chunk_to_bytes(header.sender, relay.joiner, header.step, header.total_bytes, data)
        except RoundError as error:
            await _abort(context, error)
        finally:
            self.relays.close(relay)

    async def PutState(self, requests: AsyncIterator[RawRequest], context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        """A live member sends a waiting joiner the state; its first chunk admits the joiner from its step on."""
        relay = None
        try:
            async for raw in requests:
                chunk = await _call(context, serde.state_chunk_from_bytes, raw.take())
                if relay is None:
                    await _call(context, check_scope, chunk.job_id, chunk.rank)
                    header = StateHeader(chunk.rank, chunk.step, chunk.total_bytes)
                    relay = await _call(
                        context, self.relays.claim, chunk.job_id, chunk.rank, chunk.incarnation, chunk.joiner, header
                    )
                await relay.put(chunk.data)
            if relay is None:
                raise InvalidArgumentError("PutState sent no chunk; expected the state's first chunk with its header")
            await relay.end()
            return serde.put_state_response_to_bytes(relay.relayed)
        except RoundError as error:
            if relay is not None:
                relay.fail(error)
            await _abort(context, error)
        except BaseException:  # the call itself was cancelled mid-stream
            if relay is not None:
                relay.fail(UnavailableError(f"member {relay.header.sender if relay.header else '?'} stopped sending"))
            raise

    async def SeedOuter(self, raw: RawRequest, context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        """DiLoCo: a member seeds, or checks, the job's global state for one round key."""
        request = await _in_pool(context, serde.seed_from_bytes, raw.take())
        await _call(context, check_scope, request.job_id, request.rank)
        seeded = await _in_pool(context, outer_service.seed, self.table, request)
        parameters, momentum = seeded.held or (b"", b"")
        return serde.seeded_to_bytes(seeded.matched, seeded.step, parameters, momentum)

    def outer_boundary(self, job: Job, step: int) -> None:
        """A DiLoCo job's global state is whole before outer round ``step``: its waiting joiners receive it."""
        if self._loop is not None:  # known from the first Watch; a DiLoCo member opens one when it joins
            self.outer_joiners.boundary(job, step, self._loop)

    async def Leave(self, raw: RawRequest, context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        request = await _call(context, serde.leave_from_bytes, raw.take())
        await _call(context, check_scope, request.job_id, request.rank)
        await _in_pool(context, self.table.leave, request.job_id, request.rank, request.incarnation)
        return pb.LeaveResponse().SerializeToString()


def package_result(result: RoundResult, incarnation: str, step: int, bucket: int) -> bytes:
    """The serialized PushPullResponse for a finished round (the table calls this once)."""
    return serde.result_to_bytes(result, incarnation, step, bucket)


def _as_bytes(response: bytes) -> bytes:
    return response


def aggregator_handlers(servicer: AggregatorServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Method name -> handler for every RPC of the Aggregator service; each takes and returns raw bytes."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=RawRequest, response_serializer=_as_bytes
        )
        for name in ("Join", "PushPull", "Leave", "SeedOuter")
    }
    for name in ("FetchState",):
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            getattr(servicer, name), request_deserializer=RawRequest, response_serializer=_as_bytes
        )
    handlers["PutState"] = grpc.stream_unary_rpc_method_handler(
        servicer.PutState, request_deserializer=RawRequest, response_serializer=_as_bytes
    )
    for name in ("PushPullStream", "Watch"):
        handlers[name] = grpc.stream_stream_rpc_method_handler(
            getattr(servicer, name), request_deserializer=RawRequest, response_serializer=_as_bytes
        )
    return handlers


def add_aggregator_to_server(servicer: AggregatorServicer, server: grpc.aio.Server) -> None:
    """Register the Aggregator service's methods on ``server``."""
    handlers = aggregator_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


async def _call(context: grpc.aio.ServicerContext, action: Callable[..., T], *args: object) -> T:
    """``action(*args)`` on the loop (it must not block), its RoundError turned into the call's status."""
    try:
        return action(*args)
    except RoundError as error:
        await _abort(context, error)


async def _in_pool(context: grpc.aio.ServicerContext, action: Callable[..., T], *args: object) -> T:
    """``action(*args)`` on the executor (it takes round locks or decodes), its RoundError turned into the status."""
    try:
        return await asyncio.to_thread(action, *args)
    except RoundError as error:
        await _abort(context, error)


async def _abort(context: grpc.aio.ServicerContext, error: RoundError) -> NoReturn:
    if error.refusal is not Refusal.UNSPECIFIED:  # the client decides on the reason, never on the message
        context.set_trailing_metadata(((REFUSAL_METADATA_KEY, error.refusal.name),))
    await context.abort(grpc.StatusCode[error.code], bounded_details(str(error)))
    raise AssertionError("context.abort returned")  # abort always raises
