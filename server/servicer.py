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
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc

from gradq.proto.transport import REFUSAL_METADATA_KEY, bounded_details
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantizedArray
from gradq.server import outer_service, serde
from gradq.server.auth import check_scope, scoped_rank
from gradq.server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    Refusal,
    ResourceExhaustedError,
    RoundError,
    UnavailableError,
)
from gradq.server.job_spec import JobSpec
from gradq.server.jobs import Job
from gradq.server.liveness import Liveness
from gradq.server.membership import ANY_RANK
from gradq.server.outer_service import OuterJoiners
from gradq.server.rounds import JoinAnswer, RoundResult, RoundTable, RoundTicket
from gradq.server.state_relay import StateHeader, StateRelays
from gradq.server.waiting import WaitingCalls, peer_host

__all__ = ["AggregatorServicer", "add_aggregator_to_server", "aggregator_handlers", "SERVICE_NAME"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name

log = logging.getLogger(__name__)

T = TypeVar("T")

# Requests up to this size are parsed on the event loop (tens of microseconds: the checks cost per
# channel, not per element); larger ones on the pool. 4 MiB holds a 2^22-element 4-bit push and a
# 2^21-element 8-bit one with their qparams.
_ON_LOOP_BYTES = 4 << 20
# A contribution of up to this many elements is decoded into its round on the event loop (about
# 0.1-0.3 ms per 2^20 elements, less than gRPC's own work for the call), saving the hop to a
# pool thread and back (a thread woken, then the loop through its self-pipe: measured as about a
# fifth of the aggregator's CPU per push at 2^20 elements). Only when that cannot stall the other
# calls (RoundTable.try_add): not a round's last contribution (its re-encode goes to the pool), not
# while a pool thread holds the round's lock, and not a grid whose kernels have not yet run in
# this process (their first load takes seconds).
_ON_LOOP_ELEMENTS = 1 << 21
# How long a push refused for want of memory or open rounds waits for its answer (bench/abuse.py).
_REFUSAL_PAUSE_S = 0.1
# Pushes one PushPullStream may have read that are not yet in their rounds: being parsed, admitted or
# accumulated (each holds its request, at most --max-message-bytes), or refused there and not yet written
# (each a PushPullResponse of at most MAX_DETAILS_CHARACTERS of details). A push in its round holds a
# waiting slot instead, capped as waiting calls are. Past this many the stream is not read until they
# move on, so a client that never reads its refusals leaves at most this many with the server, not every
# push it sent ahead (each refusal may quote a long job id). 32 keeps the pool's threads busy with one
# stream's large pushes, and a reading client's refusals flowing.
_UNADMITTED_PER_STREAM = 32
# How long a Join whose model disagrees with another host's waits for the start quorum to decide, at most
# (see AggregatorServicer._await_model).
_MODEL_WAIT_S = 60.0


class RawRequest:
    """A request's undecoded bytes; the handler parses them and lets them go."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def take(self) -> bytes:
        data, self.data = self.data, b""
        return data


@dataclass(frozen=True, slots=True)
class _Streamed:
    """What a PushPullStream's writer takes next: an answer to write, or news of the stream itself."""

    data: bytes  # a serialized PushPullResponse; empty for news
    # The (job, peer) waiting slot the answer holds until it is written; None: the push never got into its
    # round, and its answer holds one of the stream's ``_UNADMITTED_PER_STREAM`` places instead.
    slot: tuple[str, str] | None = None
    end: bool = False  # the client sent its last push
    ending: RoundError | None = None  # end the call with this status


class LoopWakeups:
    """Carries wake-ups from other threads to one event loop, one ``call_soon_threadsafe`` per batch.

    A round finished on a pool thread wakes each of its W waiting calls; one
    self-pipe write (and loop wake-up) for all of them instead of one each.
    """

    __slots__ = ("_lock", "_loop", "_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[LoopWaker] = []

    def post(self, waker: LoopWaker) -> None:
        """Have ``waker.wake()`` run on the loop soon (from any thread but the loop's)."""
        with self._lock:
            self._pending.append(waker)
            first = len(self._pending) == 1
        if first:  # later posts ride on the batch already scheduled, until it runs
            # A closed loop raises RuntimeError: the server has stopped and its calls are gone.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for waker in pending:
            waker.wake()


class LoopWaker:
    """Wakes a call waiting on the event loop; a round sets it from whichever thread finished it.

    Made on the loop's thread. ``woken`` is a bare future, not an Event under
    ``wait_for``: no task and no extra callbacks per waiting call.
    """

    __slots__ = ("_thread", "_wakeups", "woken")

    def __init__(self, loop: asyncio.AbstractEventLoop, wakeups: LoopWakeups) -> None:
        self._thread = threading.get_ident()
        self._wakeups = wakeups
        self.woken: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        if threading.get_ident() == self._thread:
            self.wake()  # the round finished on the loop: no self-pipe write needed
            return
        self._wakeups.post(self)

    def wake(self) -> None:
        """Resolve ``woken`` (on the loop's thread); later calls do nothing."""
        if not self.woken.done():
            self.woken.set_result(None)


class AggregatorServicer:
    """Thin: every method is decode -> RoundTable -> encode, on grpc.aio's event loop.

    Checks that can refuse a push run on the loop, without a pass over its
    payload. Work that may wait for a round's lock or run long (joining,
    averaging and re-encoding a round, leaving, a push's first decode of its
    grid) runs on the loop's default executor, a small thread pool; a push
    that can neither wait nor finish its round is decoded into it on the loop
    (see ``_ON_LOOP_BYTES`` and ``_ON_LOOP_ELEMENTS``). A PushPull then waits for its round as a
    coroutine, so a parked call costs no thread. The calls are capped (``WaitingCalls``)
    for their memory. ``asyncio.to_thread`` carries the call's token scope
    into the pool.

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
        table.membership_changed = self.membership_changed
        self.outer_joiners = OuterJoiners(table, self.relays)
        table.outer_boundary = self._outer_boundary
        self._observe_membership = membership_observer
        # Set when the server stops: every Watch ends (OK) rather than holding the stop for its grace,
        # and so does every PushPullStream once its pushes are answered.
        self._stopping = asyncio.Event()
        # The answer queue of each open PushPullStream, to wake its writer when the server stops.
        self._push_streams: set[asyncio.Queue[_Streamed]] = set()
        # Each elastic job's open Watch streams, woken to send its members whenever they change.
        self._watchers: dict[Job, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, known from the first Watch
        # Joins waiting for their job's start quorum to decide its model, by job id: woken when its vote may have
        # changed (the table's ``model_vote_changed``). Touched on the loop only; the loop is known from the first.
        self._model_waits: dict[str, set[asyncio.Event]] = {}
        self._model_loop: asyncio.AbstractEventLoop | None = None
        table.model_vote_changed = self._model_vote_changed
        # Lets clients notice an aggregator restart (their rounds were lost).
        self.server_id = uuid.uuid4().hex
        # (scheme, bits) of the pushes a pool thread has decoded: their kernels are loaded in this process.
        self._warm_grids: set[tuple[int, int]] = set()
        # Wake-ups of waiting PushPulls from pool threads, batched per loop (made on the loop, in ``_wait``).
        self._wakeups: LoopWakeups | None = None
        self._wakeups_loop: asyncio.AbstractEventLoop | None = None

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
                if await _call(context, self.table.model_decided, spec.job_id, answer.rank, answer.incarnation):
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
            self.table.give_up_join(spec.job_id, answer.rank, answer.incarnation)
            if isinstance(error, RoundError):
                await _abort(context, error)
            raise
        finally:
            waits.discard(changed)
            if not waits and self._model_waits.get(spec.job_id) is waits:
                del self._model_waits[spec.job_id]

    def _model_vote_changed(self, job_id: str) -> None:
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
            handed = [await _parsed(serde.contribution_from_bytes, raw.take())]
            return await self._push(handed, peer, slot.append)
        except RoundError as error:
            await _abort(context, error)
        finally:
            for held in slot:  # a unary call's answer is written as the handler returns
                self.waiting.release(*held)

    async def PushPullStream(  # noqa: N802
        self, requests: AsyncIterator[RawRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """PushPull's pushes as one stream's messages, each answered as its round finishes.

        Every push read becomes a task of its own, so the stream is read on
        while earlier pushes wait for their rounds; each holds a waiting slot
        (``WaitingCalls``) until its answer is written, so a client that stops
        reading answers is held to the same caps as its waiting calls, and a
        push past a cap is refused as a PushPull call would be. What one
        stream holds is bounded whether or not its client reads: at most
        ``_UNADMITTED_PER_STREAM`` pushes not yet in their rounds (a request
        or a refusal each), and the pushes holding waiting slots (at most
        --max-waiting-per-peer, with their answers once their rounds end),
        plus gRPC's own buffers. With every place taken the stream is not
        read until one frees, and gRPC's flow control holds the client.
        """
        peer = peer_host(context.peer())
        answers: asyncio.Queue[_Streamed] = asyncio.Queue()
        unadmitted = asyncio.Semaphore(_UNADMITTED_PER_STREAM)
        pushes: set[asyncio.Task[None]] = set()
        unanswered = 0

        async def serve(data: bytes) -> None:
            answers.put_nowait(await self._streamed_push(data, peer, unadmitted.release))

        async def read() -> None:
            nonlocal unanswered
            messages = aiter(requests)
            try:
                while True:
                    await unadmitted.acquire()  # before the read: a push that finds no place stays with gRPC
                    try:
                        raw = await anext(messages)
                    except StopAsyncIteration:
                        break
                    unanswered += 1
                    task = asyncio.create_task(serve(raw.take()))
                    pushes.add(task)
                    task.add_done_callback(pushes.discard)
                answers.put_nowait(_Streamed(b"", end=True))
            except Exception as error:  # the request stream broke: end the call with it
                answers.put_nowait(_Streamed(b"", ending=UnavailableError(f"the request stream failed: {error}")))

        try:  # counted per client host, whatever connection it came on
            self.waiting.open_stream(peer)
        except RoundError as error:
            await _abort(context, error)
        self._push_streams.add(answers)
        reader = asyncio.create_task(read())
        read_all = False
        try:
            # Until the client has sent its last push and every push is answered; or, once the server
            # stops (its rounds settled), as soon as none is unanswered: the client's next push fails
            # over to a new call, as a unary one would.
            while not ((read_all or self._stopping.is_set()) and unanswered == 0):
                answer = await answers.get()
                if answer.ending is not None:
                    await _abort(context, answer.ending)
                read_all = read_all or answer.end
                if not answer.data:
                    continue  # the end of the requests, or the server stopping: check again
                try:
                    yield answer.data
                finally:  # written, or the call ended while it was being written
                    if answer.slot is not None:
                        self.waiting.release(*answer.slot)
                unanswered -= 1
                if answer.slot is None:
                    unadmitted.release()  # refused before its round: its place was held until now
        finally:
            self.waiting.close_stream(peer)
            self._push_streams.discard(answers)
            reader.cancel()
            for task in list(pushes):
                task.cancel()  # a push cancelled while it waits stays counted, as with a cancelled PushPull
            while not answers.empty():
                left = answers.get_nowait()
                if left.slot is not None:
                    self.waiting.release(*left.slot)

    async def _streamed_push(self, data: bytes, peer: str, in_round: Callable[[], None]) -> _Streamed:
        """One PushPullStream push, start to answer: a PushPullResponse naming its push, never an exception.

        ``in_round`` is called once the push is accumulated into its round. From then on the push's answer,
        its round's mean or a refusal, keeps the push's waiting slot until it is written; a push refused
        before that gives its slot back at once (its job id may be no job's, and is not kept).
        """
        try:
            push = await _parsed(serde.streamed_push_from_bytes, data)
        except RoundError as error:  # not a PushPullRequest: no sequence to answer with
            return _Streamed(b"", ending=error)
        del data
        sequence, round_answers, parsed = push.sequence, push.round_answers, push.parsed
        del push  # holds the contribution, whose payload must not outlive its accumulation
        slot: list[tuple[str, str]] = []  # the push's waiting slot, once it is in its round

        def accumulated(held: tuple[str, str]) -> None:
            slot.append(held)
            in_round()

        try:
            if isinstance(parsed, RoundError):
                raise parsed
            handed = [parsed]
            del parsed
            packaged = await self._push(handed, peer, accumulated)
            # A client that names its pushes' answers by round gets the bytes every waiter of the round shares
            # (written as they are: no copy of the mean per push); one that names them only by sequence, a copy
            # with its push's sequence appended.
            answer = packaged if round_answers else serde.streamed_answer(packaged, sequence)
        except RoundError as error:
            answer = serde.streamed_refusal(sequence, _status_code(error.code), str(error), error.refusal.value)
        except Exception as error:  # a bug: answer as gRPC answers a unary handler's, and keep the stream
            log.exception("PushPullStream push %d failed", sequence)
            details = f"{type(error).__name__}: {error}"
            answer = serde.streamed_refusal(sequence, _status_code("UNKNOWN"), details)
        except BaseException:  # cancelled: the stream ended first
            for held in slot:
                self.waiting.release(*held)
            raise
        return _Streamed(answer, slot=slot[0] if slot else None)

    async def _push(
        self, handed: list[serde.Contribution], peer: str, in_round: Callable[[tuple[str, str]], None]
    ) -> bytes:
        """One push from its scope check to its round's packaged mean: the one path of PushPull and a stream.

        Args:
            handed: the push, in a list this takes it out of, so that nothing holds its payload once it is
                accumulated (the caller keeps no reference).
            peer: the client host, whose waiting slot for the job the push takes.
            in_round: called with that (job, peer) slot once the push is accumulated into its round: from
                then on the caller gives the slot back (when the answer is written); a push refused before
                gives it back here at once (its job id may be no job's, and is not kept).

        Raises:
            RoundError: the push was refused, or its round failed.
        """
        contribution = handed.pop()
        job_id = contribution.job_id
        check_scope(job_id, contribution.rank)
        self.waiting.acquire(job_id, peer)
        try:
            ticket = await self._add(contribution)
        except BaseException:
            self.waiting.release(job_id, peer)
            raise
        del contribution  # accumulated: nothing of the payload need outlive the push
        in_round((job_id, peer))
        result = await self._wait(ticket)
        assert isinstance(result.packaged, bytes), "the table packages every result"
        return result.packaged

    async def _add(self, contribution: serde.Contribution) -> RoundTicket:
        """Admit the contribution to its round and accumulate it; raises RoundError."""
        ticket = await self._admit(contribution)
        if not self._added_on_loop(ticket, contribution):
            await asyncio.to_thread(self.table.add, ticket, contribution.tensor, contribution.non_finite)
            self._warm_grids.add(_grid_of(contribution.tensor))
        return ticket

    def _added_on_loop(self, ticket: RoundTicket, contribution: serde.Contribution) -> bool:
        """Whether the contribution went into its round here on the loop (see ``_ON_LOOP_ELEMENTS``)."""
        tensor = contribution.tensor
        if contribution.non_finite or tensor.numel > _ON_LOOP_ELEMENTS or _grid_of(tensor) not in self._warm_grids:
            return False
        return self.table.try_add(ticket, tensor)

    async def _admit(self, contribution: serde.Contribution) -> RoundTicket:
        """The push's round; raises RoundError."""
        try:
            return self.table.admit(
                contribution.job_id,
                contribution.step,
                contribution.bucket,
                contribution.rank,
                contribution.tensor,
                contribution.incarnation,
                contribution.weight,
            )
        except ResourceExhaustedError:
            # Out of memory budget or rounds: answered after a pause, holding the push's waiting
            # slot but no thread, so a client that retries at once cannot turn refusals (each
            # costs gRPC ~0.5 ms of CPU) into a flood that starves the other jobs.
            await asyncio.sleep(_REFUSAL_PAUSE_S)
            raise

    async def _wait(self, ticket: RoundTicket) -> RoundResult:
        """Wait for the ticket's round without holding a thread; raises RoundError.

        When the client cancels or its deadline passes, gRPC cancels this
        coroutine at the ``await``: the call ends at once and its contribution
        stays counted.
        """
        loop = asyncio.get_running_loop()
        if self._wakeups is None or self._wakeups_loop is not loop:
            self._wakeups, self._wakeups_loop = LoopWakeups(loop), loop
        waker = LoopWaker(loop, self._wakeups)
        timeout = self.table.watch(ticket, waker)
        if timeout is not None:
            deadline = loop.call_later(timeout, waker.wake)  # then ``answer`` closes the round
            try:
                await waker.woken
            finally:
                deadline.cancel()
                self.table.unwatch(ticket, waker)
        if ticket.round.done.is_set():
            return self.table.answer(ticket)
        return await asyncio.to_thread(self.table.answer, ticket)  # closes the round over the ranks it has

    async def Watch(self, raw: RawRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:  # noqa: N802
        """Stay open while the rank lives: a parked coroutine, no thread; its end without a Leave loses the rank."""
        request = await _call(context, serde.watch_from_bytes, raw.take())
        await _call(context, check_scope, request.job_id, request.rank)
        watch = await _call(context, self.liveness.open, request.job_id, request.rank, request.incarnation)
        self._loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        self._watchers.setdefault(watch.job, set()).add(changed)
        try:
            yield self._watch_event(watch.job)
            # Until the server stops or gRPC cancels the call (the client went); an elastic
            # job's membership changes meanwhile are sent on, coalesced to the latest.
            while not self._stopping.is_set():
                await changed.wait()
                changed.clear()
                if not self._stopping.is_set():
                    yield self._watch_event(watch.job)
        finally:
            watchers = self._watchers.get(watch.job, set())
            watchers.discard(changed)
            if not watchers:
                self._watchers.pop(watch.job, None)
            # Not awaited: the call is being cancelled. Closing rounds takes their locks, so off the loop.
            asyncio.get_running_loop().run_in_executor(None, self.liveness.close, watch)

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
        for watchers in self._watchers.values():
            for changed in watchers:
                changed.set()
        for answers in self._push_streams:
            answers.put_nowait(_Streamed(b""))

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

    def _outer_boundary(self, job: Job, step: int) -> None:
        if self._loop is not None:  # known from the first Watch; a DiLoCo member opens one when it joins
            self.outer_joiners.boundary(job, step, self._loop)

    async def Leave(self, raw: RawRequest, context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        request = await _call(context, serde.leave_from_bytes, raw.take())
        await _call(context, check_scope, request.job_id, request.rank)
        await _in_pool(context, self.table.leave, request.job_id, request.rank, request.incarnation)
        return pb.LeaveResponse().SerializeToString()


def _grid_of(tensor: QuantizedArray) -> tuple[int, int]:
    """What picks a contribution's decoding kernels: its scheme and bits."""
    return int(tensor.scheme), tensor.bits


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
    for name in ("Watch", "FetchState"):
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            getattr(servicer, name), request_deserializer=RawRequest, response_serializer=_as_bytes
        )
    handlers["PutState"] = grpc.stream_unary_rpc_method_handler(
        servicer.PutState, request_deserializer=RawRequest, response_serializer=_as_bytes
    )
    handlers["PushPullStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.PushPullStream, request_deserializer=RawRequest, response_serializer=_as_bytes
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


async def _parsed(parse: Callable[[bytes], T], data: bytes) -> T:
    """``parse(data)``: on the loop when ``data`` is small (see ``_ON_LOOP_BYTES``), else on the executor."""
    if len(data) <= _ON_LOOP_BYTES:
        return parse(data)
    return await asyncio.to_thread(parse, data)


def _status_code(name: str) -> int:
    """The google.rpc.Code number of a ``grpc.StatusCode`` name."""
    code: int = grpc.StatusCode[name].value[0]
    return code


async def _abort(context: grpc.aio.ServicerContext, error: RoundError) -> NoReturn:
    if error.refusal is not Refusal.UNSPECIFIED:  # the client decides on the reason, never on the message
        context.set_trailing_metadata(((REFUSAL_METADATA_KEY, error.refusal.name),))
    await context.abort(grpc.StatusCode[error.code], bounded_details(str(error)))
    raise AssertionError("context.abort returned")  # abort always raises
