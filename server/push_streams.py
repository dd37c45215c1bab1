"""PushStreams: every push's way from its bytes to its round's mean, alone (PushPull) or on a PushPullStream.

Kept apart from the servicer, which stays the RPC surface (decode, call
plain logic, map a refusal to a status): a push needs an engine of its own,
one for both of its calls. It parses and decodes on the event loop or the
pool by size, checks the scope, takes the waiting slot, admits and
accumulates into the round, and waits for the round as a coroutine woken
from whichever thread finishes it (``LoopWakeups`` batches those wake-ups).
A PushPullStream adds a reader task that turns each message into a task of
its own, a writer that yields answers as rounds finish, and the per-stream
bound on what a client that does not read can leave with the server.

Threads: everything here runs on grpc.aio's event loop, but for the work
handed to the loop's default executor (a large parse, a push's first decode
of its grid, closing a round) and the wake-ups a round posts from a pool
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from gradq.qcore import QuantizedArray
from gradq.server import serde
from gradq.server.auth import check_scope
from gradq.server.errors import ResourceExhaustedError, RoundError, UnavailableError
from gradq.server.rounds import RoundResult, RoundTable, RoundTicket
from gradq.server.waiting import WaitingCalls

__all__ = ["LoopWaker", "LoopWakeups", "PushStreams", "RawMessage"]

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


class RawMessage(Protocol):
    """A request message's undecoded bytes, handed over once (the servicer's ``RawRequest``)."""

    def take(self) -> bytes: ...


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


class PushStreams:
    """The pushes of one server's calls, unary and streamed (see the module docstring).

    Args:
        table: the round logic.
        waiting: caps on pushes waiting for their rounds, and on the streams a client host holds open.
    """

    def __init__(self, table: RoundTable, waiting: WaitingCalls) -> None:
        self.table = table
        self.waiting = waiting
        # Set when the server stops: every PushPullStream ends once its pushes are answered.
        self._stopping = False
        # The answer queue of each open PushPullStream, to wake its writer when the server stops.
        self._streams: set[asyncio.Queue[_Streamed]] = set()
        # (scheme, bits) of the pushes a pool thread has decoded: their kernels are loaded in this process.
        self._warm_grids: set[tuple[int, int]] = set()
        # Wake-ups of waiting PushPulls from pool threads, batched per loop (made on the loop, in ``_wait``).
        self._wakeups: LoopWakeups | None = None
        self._wakeups_loop: asyncio.AbstractEventLoop | None = None

    async def push(self, data: bytes, peer: str, in_round: Callable[[tuple[str, str]], None]) -> bytes:
        """One PushPull call's push, from its bytes to its round's packaged mean.

        Args:
            data: the serialized PushPullRequest (the caller keeps no reference: its payload is let go once
                it is accumulated).
            peer: the client host, whose waiting slot for the job the push takes.
            in_round: called with that (job, peer) slot once the push is accumulated into its round: from
                then on the caller gives the slot back (when the answer is written).

        Raises:
            RoundError: the request is malformed, the push was refused, or its round failed.
        """
        handed = [await _parsed(serde.contribution_from_bytes, data)]
        del data
        return await self._push(handed, peer, in_round)

    async def serve(self, requests: AsyncIterator[RawMessage], peer: str) -> AsyncGenerator[bytes, None]:
        """One PushPullStream call: its pushes, each answered as its round finishes (the answers to write).

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

        Args:
            requests: the call's request messages, undecoded.
            peer: the client host: its streams and waiting pushes are counted together.

        Raises:
            RoundError: the call ends with this status: the client host holds too many streams, a message is
                not a PushPullRequest, or the request stream broke.
        """
        answers: asyncio.Queue[_Streamed] = asyncio.Queue()
        unadmitted = asyncio.Semaphore(_UNADMITTED_PER_STREAM)
        pushes: set[asyncio.Task[None]] = set()
        unanswered = 0

        async def answer_push(data: bytes) -> None:
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
                    task = asyncio.create_task(answer_push(raw.take()))
                    pushes.add(task)
                    task.add_done_callback(pushes.discard)
                answers.put_nowait(_Streamed(b"", end=True))
            except Exception as error:  # the request stream broke: end the call with it
                answers.put_nowait(_Streamed(b"", ending=UnavailableError(f"the request stream failed: {error}")))

        self.waiting.open_stream(peer)  # counted per client host, whatever connection it came on
        self._streams.add(answers)
        reader = asyncio.create_task(read())
        read_all = False
        try:
            # Until the client has sent its last push and every push is answered; or, once the server
            # stops (its rounds settled), as soon as none is unanswered: the client's next push fails
            # over to a new call, as a unary one would.
            while not ((read_all or self._stopping) and unanswered == 0):
                answer = await answers.get()
                if answer.ending is not None:
                    raise answer.ending
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
            self._streams.discard(answers)
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

    def stop(self) -> None:
        """End each PushPullStream as soon as none of its pushes is unanswered: the server is stopping (on the loop).

        Its rounds are settled by then: a client's next push fails over to a new call, as a unary one would.
        """
        self._stopping = True
        for answers in self._streams:
            answers.put_nowait(_Streamed(b""))


def _grid_of(tensor: QuantizedArray) -> tuple[int, int]:
    """What picks a contribution's decoding kernels: its scheme and bits."""
    return int(tensor.scheme), tensor.bits


async def _parsed(parse: Callable[[bytes], T], data: bytes) -> T:
    """``parse(data)``: on the loop when ``data`` is small (see ``_ON_LOOP_BYTES``), else on the executor."""
    if len(data) <= _ON_LOOP_BYTES:
        return parse(data)
    return await asyncio.to_thread(parse, data)


def _status_code(name: str) -> int:
    """The google.rpc.Code number of a ``grpc.StatusCode`` name."""
    code: int = grpc.StatusCode[name].value[0]
    return code
