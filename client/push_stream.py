"""A shard's pushes as the messages of one PushPullStream call, each answered like a unary PushPull.

A unary PushPull costs gRPC-Python a call's setup and teardown at both ends
(bench/call_vs_stream.py: about half of a bare aggregator's CPU per 4-bit
push). Here one bidirectional stream per shard carries them all: the rank's
threads put requests on the stream's outbox and get back a ``StreamedReply``,
which reads like the ``grpc.Future`` of a unary call (``code``, ``details``,
``result``, ``add_done_callback``), so ``ShardSender`` settles, retries and
fails pushes the same way over either. Answers come as rounds finish, a
refusal named by the push's ``sequence``, a mean by its round (the same bytes
for every waiter of the round, so the aggregator copies no mean per push); a
thread per stream reads them, and one per process fails a push whose answer
is later than the deadline a unary call would have.
When the call ends (the aggregator went away, restarted or stopped), every
unanswered push gets the call's status and the next push opens a new call.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gradq.client import serde

__all__ = ["PushStream", "StreamedReply"]

log = logging.getLogger(__name__)

# A stream the aggregator ended cleanly with pushes unanswered (it stopped, or the client sent
# after its last answer): they are resent, like pushes whose call found the aggregator gone.
_ENDED = (grpc.StatusCode.UNAVAILABLE, "the aggregator ended the push stream before answering")


class StreamedReply:
    """One push's answer on a stream: the part of ``grpc.Future``'s interface ``ShardSender`` reads."""

    __slots__ = ("_callbacks", "_code", "_data", "_details", "_lock", "_refusal")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._refusal = serde.Refusal.UNSPECIFIED
        self._data = b""
        self._callbacks: list[Callable[[StreamedReply], None]] = []

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def refusal(self) -> serde.Refusal:
        """Why the aggregator refused the push (a proto Refusal's name, ``"NOT_JOINED"``); "" for none."""
        return self._refusal

    def result(self) -> bytes:
        """The PushPullResponse's bytes (for an answer with code OK)."""
        return self._data

    def add_done_callback(self, callback: Callable[[StreamedReply], None]) -> None:
        """Run ``callback(self)`` once settled: at once if it is, else on the thread that settles it."""
        with self._lock:
            if self._code is None:
                self._callbacks.append(callback)
                return
        self._run(callback)

    def settle(
        self, code: grpc.StatusCode, details: str, data: bytes = b"", refusal: serde.Refusal = serde.Refusal.UNSPECIFIED
    ) -> bool:
        """Settle once; False if it already was."""
        with self._lock:
            if self._code is not None:
                return False
            self._code, self._details, self._data, self._refusal = code, details, data, refusal
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._run(callback)
        return True

    def _run(self, callback: Callable[[StreamedReply], None]) -> None:
        # On the thread that reads the stream's answers or expires deadlines: one failing callback
        # must stop neither, as gRPC's own futures log a failing callback and go on.
        try:
            callback(self)
        except Exception:
            log.exception("a callback of a streamed push failed")


class _Call:
    """One PushPullStream call: its outbox, its unanswered pushes and the thread that reads its answers."""

    def __init__(self, start: Callable[[Iterator[bytes]], Any]) -> None:
        self.lock = threading.Lock()
        self.ended = False
        self.unanswered: dict[int, tuple[StreamedReply, serde.RoundKey]] = {}
        # Each round's unanswered pushes, oldest first: an answer naming a round (sequence 0) settles the first.
        self._rounds: dict[serde.RoundKey, list[int]] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        # gRPC sends what the iterator yields from a thread of its own; None half-closes the call.
        self.call = start(iter(self._outbox.get, None))
        self._reader = threading.Thread(target=self._read, name="gradq-push-stream", daemon=True)
        self._reader.start()

    def send(self, sequence: int, round_key: serde.RoundKey, request: bytes) -> StreamedReply | None:
        """Queue ``request`` (a push to ``round_key``); None when the call has ended (open a new one)."""
        reply = StreamedReply()
        with self.lock:
            if self.ended:
                return None
            self.unanswered[sequence] = (reply, round_key)
            self._rounds.setdefault(round_key, []).append(sequence)
        self._outbox.put(request)
        return reply

    def forget(self, sequence: int, reply: StreamedReply) -> None:
        """Stop waiting for ``sequence`` (its deadline passed): a late answer is dropped."""
        with self.lock:
            entry = self.unanswered.get(sequence)
            if entry is not None and entry[0] is reply:
                self._take(sequence)

    def _take(self, sequence: int) -> StreamedReply | None:
        """Remove and return the unanswered push ``sequence`` (None: there is none). Hold ``lock``."""
        entry = self.unanswered.pop(sequence, None)
        if entry is None:
            return None
        reply, round_key = entry
        waiting = self._rounds[round_key]
        waiting.remove(sequence)
        if not waiting:
            del self._rounds[round_key]
        return reply

    def _answered(self, answer: serde.StreamAnswer) -> StreamedReply | None:
        """The push ``answer`` settles, taken off the unanswered ones; None when none waits for it. Hold ``lock``."""
        sequence = answer.sequence
        if sequence == 0:  # a round's mean, the same bytes for all its waiters: its push is the round's oldest
            waiting = self._rounds.get(answer.round)
            if not waiting:
                return None
            sequence = waiting[0]
        return self._take(sequence)

    def cancel(self) -> None:
        self._outbox.put(None)
        self.call.cancel()

    def _read(self) -> None:
        code, details = _ENDED
        refusal = serde.Refusal.UNSPECIFIED
        try:
            for data in self.call:
                answer = serde.stream_answer_of(data)
                with self.lock:
                    reply = self._answered(answer)
                if reply is not None:  # None: answered after its deadline, or not this client's push
                    reply.settle(answer.code, answer.details, data, answer.refusal)
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
            refusal = serde.refusal_of_metadata(error.trailing_metadata())
        except ValueError as error:  # a malformed answer: the call cannot be trusted to name pushes
            code, details = grpc.StatusCode.INTERNAL, f"malformed PushPullStream answer: {error}"
            self.call.cancel()
        with self.lock:
            self.ended = True
            unanswered, self.unanswered = self.unanswered, {}
            self._rounds.clear()
        self._outbox.put(None)  # gRPC's sending thread ends too
        for reply, _ in unanswered.values():
            reply.settle(code, details, refusal=refusal)


class _Deadlines:
    """One thread per process that fails the pushes of every ``PushStream`` whose deadline passed.

    It sleeps until the earliest deadline of any stream; a push whose deadline
    comes before the planned wake-up (a stream with a shorter timeout) wakes it.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._streams: weakref.WeakSet[PushStream] = weakref.WeakSet()
        self._wake_at = math.inf  # while it looks at the streams: any new deadline makes it look again
        self._rescan = False
        self._thread: threading.Thread | None = None

    def watch(self, stream: PushStream, deadline: float) -> None:
        """``stream`` has a push due by ``deadline`` (monotonic seconds)."""
        with self._condition:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gradq-push-deadlines", daemon=True)
                self._thread.start()
            if deadline < self._wake_at:
                self._wake_at, self._rescan = deadline, True
                self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._rescan, self._wake_at = False, math.inf
                streams = list(self._streams)
            earliest = min((stream.expire() for stream in streams), default=math.inf)
            del streams  # a closed stream may go
            with self._condition:
                if not self._rescan:
                    self._wake_at = earliest
                    self._condition.wait(None if earliest == math.inf else max(0.0, earliest - time.monotonic()))


_DEADLINES = _Deadlines()


class PushStream:
    """One shard's stream of pushes, opened on the first push and again after each call ends.

    Args:
        open_call: starts a PushPullStream call with a request iterator
            (the channel's ``stream_stream`` callable, metadata bound).
        timeout_s: a push not answered this long after it was queued fails
            with DEADLINE_EXCEEDED, as a unary call's deadline would fail it.
    """

    def __init__(self, open_call: Callable[[Iterator[bytes]], Any], timeout_s: float) -> None:
        self._open_call = open_call
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._call: _Call | None = None
        self._closed = False
        # Unanswered pushes -> (deadline, call, sequence), oldest first (every push gets the same timeout);
        # an answered one leaves at once, so this holds no answer's bytes.
        self._deadlines: OrderedDict[StreamedReply, tuple[float, _Call, int]] = OrderedDict()

    def send(self, request: bytes, sequence: int) -> StreamedReply:
        """Send one push (a serialized PushPullRequest carrying ``sequence``); its answer settles the reply.

        Raises:
            ValueError: the stream is closed (as a closed channel's calls raise), or ``request`` is no
                PushPullRequest.
        """
        round_key = serde.round_of_push(request)
        with self._lock:
            if self._closed:
                raise ValueError("the push stream is closed")
            call, reply = self._queue(request, sequence, round_key)
            deadline = time.monotonic() + self.timeout_s
            self._deadlines[reply] = (deadline, call, sequence)
        _DEADLINES.watch(self, deadline)
        reply.add_done_callback(self._answered)  # outside the lock: it runs here if already answered
        return reply

    def _queue(self, request: bytes, sequence: int, round_key: serde.RoundKey) -> tuple[_Call, StreamedReply]:
        """Queue the push on the current call, or on a new one if it has ended (hold ``_lock``)."""
        while True:
            if self._call is None or self._call.ended:
                self._call = _Call(self._open_call)
            call = self._call
            reply = call.send(sequence, round_key, request)
            if reply is not None:
                return call, reply

    def close(self) -> None:
        """End the current call: its unanswered pushes fail (CANCELLED); later sends raise ValueError."""
        with self._lock:
            self._closed = True
            call, self._call = self._call, None
        if call is not None:
            call.cancel()

    def _answered(self, reply: StreamedReply) -> None:
        with self._lock:
            self._deadlines.pop(reply, None)

    def expire(self) -> float:
        """Fail the pushes whose deadline has passed; returns the next deadline (inf: none)."""
        now = time.monotonic()
        overdue = []
        with self._lock:
            while self._deadlines:
                reply, (deadline, call, sequence) = next(iter(self._deadlines.items()))
                if deadline > now:
                    break
                del self._deadlines[reply]
                overdue.append((reply, call, sequence))
            earliest = next(iter(self._deadlines.values()))[0] if self._deadlines else math.inf
        for reply, call, sequence in overdue:
            call.forget(sequence, reply)
            reply.settle(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout_s:g} s")
        return earliest
