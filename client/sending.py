"""Pushes on the wire: each shard's send window, retries of UNAVAILABLE, and settling every push's future.

WorkerClient builds a push (a serialized PushPullRequest and where its mean
goes) and hands it here; from then on this module alone touches it. Each
shard's pushes travel as the messages of one PushPullStream
(gradq.client.push_stream), or as unary PushPull calls where the aggregator
has no such method or the client was asked for them (``UnaryPushes``). A push
that fails with UNAVAILABLE is retried with backoff after rejoining the
shard (the aggregator never counts a resent (step, bucket, rank) twice); one
that fails otherwise, or runs out of retries, fails the pushes queued behind
it on that shard at once instead of each after its own retries.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from gradq.client import serde
from gradq.client.chunks import CHUNK_KEY_STRIDE
from gradq.client.push_stream import PushStream, StreamedReply
from gradq.client.serde import Refusal
from gradq.client.shard_connections import ShardConnections
from gradq.client.stats import StatsRecorder
from gradq.client.window import ShardWindow
from gradq.qcore.arrays import ArrayCodec

__all__ = ["AggregationError", "PendingPush", "PushTransport", "ShardSender", "UnaryPushes"]

log = logging.getLogger(__name__)


# What a push hears when the aggregator's HTTP/2 keepalive closed its connection: a ping's answer
# unanswered for a minute (gradq.server.app.CONNECTION_TIMEOUT_S). Liveness itself is the Watch's
# heartbeat, on a connection no push shares, so this is a link that dropped out or queues pushes for
# that long, not a dead aggregator: the advice says so instead of asking whether it runs.
_KEEPALIVE_ADVICE = (
    "the connection was closed because a keepalive ping went unanswered for 60 s (or the aggregator's "
    "--keepalive-timeout, if longer): while this host is alive, the link dropped out for that long or its pushes "
    "and means queue on it for longer (a link far too slow for them); check the link, or raise the aggregator's "
    "--keepalive-timeout (GRADQ_KEEPALIVE_TIMEOUT) past the queue (docs/operating.md, 'Liveness on slow and long "
    "links')"
)


def _closed_by_keepalive(details: str) -> bool:
    """gRPC's words for a connection the aggregator's keepalive closed (its GOAWAY says ping_timeout)."""
    lowered = details.lower()
    return "ping timeout" in lowered or "ping_timeout" in lowered


class AggregationError(RuntimeError):
    """A call to an aggregator that produced no mean; says which aggregator and why.

    ``refusal`` is the aggregator's reason (a gradq.client.serde.Refusal, ``Refusal.NOT_JOINED``, ...;
    UNSPECIFIED, which is "", for none; its name as a string is taken too): what a client decides on, never
    ``details``, which are for people.
    """

    def __init__(
        self, address: str, code: grpc.StatusCode | None, details: str, refusal: Refusal | str = Refusal.UNSPECIFIED
    ) -> None:
        status = code.name if code is not None else "BAD_RESPONSE"
        super().__init__(f"aggregator {address}: {status}: {details}")
        self.address = address
        self.code = code
        self.details = details
        self.refusal = Refusal.named(refusal)

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray and multiprocessing carry errors between processes by pickling them; the subclasses' constructors take
        # other arguments, so the copy is rebuilt from its fields instead of through __init__.
        return (_rebuild_error, (type(self), self.args, self.__dict__))

    @classmethod
    def of_call(cls, address: str, error: Any, context: str = "") -> AggregationError:
        """The error of a failed call (a ``grpc.RpcError``, or a push's reply), its refusal read off it."""
        details = error.details() or ""
        return cls(address, error.code(), f"{context}: {details}" if context else details, refusal_of(error))


def _rebuild_error(kind: type[AggregationError], args: tuple[Any, ...], fields: dict[str, Any]) -> AggregationError:
    """An ``AggregationError`` (or subclass) unpickled: its message and fields as they were."""
    error = kind.__new__(kind)
    error.args = args
    error.__dict__.update(fields)
    return error


def refusal_of(call: Any) -> Refusal:
    """The refusal an ended call carries: a streamed push's own, or its trailing metadata's (UNSPECIFIED: none)."""
    reading = getattr(call, "refusal", None)
    if callable(reading):
        return Refusal.named(reading())
    metadata = getattr(call, "trailing_metadata", None)
    return serde.refusal_of_metadata(metadata() if callable(metadata) else None)


class Reply(Protocol):
    """A push's answer as ``ShardSender`` reads it: a unary call's ``grpc.Future``, or a ``StreamedReply``."""

    def code(self) -> grpc.StatusCode | None: ...
    def details(self) -> str | None: ...
    def result(self) -> bytes: ...
    def add_done_callback(self, callback: Callable[[Any], None]) -> None: ...


class PushTransport(Protocol):
    """How one shard's pushes reach it."""

    def send(self, request: bytes, sequence: int) -> Reply:
        """Send a serialized PushPullRequest; raises ValueError when the channel is closed."""
        ...

    def close(self) -> None: ...


class UnaryPushes:
    """A unary PushPull call per push (``metadata``: the bearer token; ``timeout_s``: each call's deadline)."""

    def __init__(
        self, push_pull: grpc.UnaryUnaryMultiCallable, timeout_s: float, metadata: tuple[tuple[str, str], ...] | None
    ) -> None:
        self._push_pull = push_pull
        self._timeout_s = timeout_s
        self._metadata = metadata

    def send(self, request: bytes, sequence: int) -> Reply:
        future: Reply = self._push_pull.future(request, timeout=self._timeout_s, metadata=self._metadata)
        return future

    def close(self) -> None:
        """Nothing to end: the channel's close ends the calls."""


@dataclass(slots=True, weakref_slot=True)
class PendingPush:
    """A push in flight: everything a retry needs to resend it unchanged."""

    shard: int
    step: int
    bucket: int  # the round key: bucket + chunk * CHUNK_KEY_STRIDE
    request: bytes  # the serialized PushPullRequest, carrying ``sequence``
    shape: tuple[int, ...]
    arrays: ArrayCodec  # the library ``out`` lives in
    out: Any  # flat float32 array or tensor: the mean is decoded into it
    result: concurrent.futures.Future[Any]
    sequence: int = 0  # names the push in its answer on a stream (ShardSender.next_sequence)
    attempt: int = 0
    sent_at: float = 0.0  # perf_counter when the latest attempt went out
    unavailable_since: float | None = None  # perf_counter of the first UNAVAILABLE: how long the shard was tried


class ShardSender:
    """Sends pushes to the shards through their windows and settles each push's future exactly once.

    Args:
        addresses: ``host:port`` of each shard, for messages.
        transports: how each shard's pushes reach it.
        unary: the unary transport of each shard, which takes over from a stream
            the shard answers UNIMPLEMENTED (an aggregator without PushPullStream).
        max_retries: retries of a call that failed with UNAVAILABLE.
        retry_backoff_s: first retry delay, doubled on each retry.
        window: the pushes per shard on the wire at once (gradq.client.window).
        stats: records every mean pulled.
        rejoin: joins a shard again (a restarted aggregator forgot the job); raises AggregationError.
        lost_self: whether a refusal's reason (gradq.client.serde.refusal_name) says the aggregator counts this
            very rank lost (it was silent past the keepalive): the push then rejoins
            and is sent again, as after a restart.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        transports: Sequence[PushTransport],
        unary: Sequence[PushTransport],
        max_retries: int,
        retry_backoff_s: float,
        window: ShardWindow[PendingPush],
        stats: StatsRecorder,
        rejoin: Callable[[int], None],
        lost_self: Callable[[Refusal], bool] = lambda refusal: False,
    ) -> None:
        self.addresses = list(addresses)
        self.transports = list(transports)
        self._unary = list(unary)
        self._replaced: list[PushTransport] = []  # streams a shard answered UNIMPLEMENTED
        self._sequences = itertools.count(1)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.window = window
        self._stats = stats
        self._rejoin = rejoin
        self._lost_self = lost_self
        self._advised: set[int] = set()  # shards whose closed connection this process has explained
        self._held_lock = threading.Lock()  # futures settle on gRPC's threads
        self.held_bytes = 0  # bytes of the requests submitted and not yet settled

    def next_sequence(self) -> int:
        """A sequence no other push of this client has (``next`` on a count is atomic under the GIL)."""
        return next(self._sequences)

    def close(self) -> None:
        """End every shard's transport: pushes still on a stream fail (CANCELLED)."""
        for transport in [*self.transports, *self._replaced]:
            transport.close()

    def submit(self, pending: PendingPush) -> None:
        """Send ``pending`` now if its shard's window has room, else once pushes before it settle."""
        size = len(pending.request)
        with self._held_lock:
            self.held_bytes += size
        pending.result.add_done_callback(functools.partial(self._settled, size))
        if self.window.admit(pending.shard, pending, size):
            self.start([pending])

    def _settled(self, size: int, settled: object) -> None:
        with self._held_lock:
            self.held_bytes -= size

    def start(self, admitted: list[PendingPush]) -> None:
        """Transmit pushes the window admitted; one failing at once hands its room to those waiting.

        A loop, not recursion: a closed channel fails a whole queue at once.
        """
        queue = collections.deque(admitted)
        while queue:
            pending = queue.popleft()
            if self._transmit(pending):
                # A weak reference: the push holding its own future's callback would be a cycle that keeps every
                # settled request (and its mean) alive until the cyclic collector runs. The future's callbacks run
                # inside set_result, while whoever settles the push still holds it.
                pending.result.add_done_callback(functools.partial(self._pass_slot, weakref.ref(pending)))
            else:
                queue.extend(self.window.release(pending.shard, pending, len(pending.request), answered=False))

    def _pass_slot(self, held: weakref.ref[PendingPush], settled: concurrent.futures.Future[Any]) -> None:
        pending = held()
        if pending is None:  # settled by no one holding it: nothing is left to measure or hand on
            return
        # Answered at the first attempt: a round trip the window measures; after a retry: counted only.
        answered: bool | None = False if settled.exception() is not None else (pending.attempt == 0 or None)
        self.start(self.window.release(pending.shard, pending, len(pending.request), answered=answered))

    def _transmit(self, pending: PendingPush) -> bool:
        """Start the RPC; False when it failed at once (``pending`` is settled)."""
        pending.sent_at = time.perf_counter()
        try:
            call = self.transports[pending.shard].send(pending.request, pending.sequence)
        except ValueError as error:  # the channel was closed: fail through the future, like any RPC error
            self.fail(pending, grpc.StatusCode.CANCELLED, str(error))
            return False
        call.add_done_callback(lambda done: self._on_reply(done, pending))
        return True

    def fail(
        self,
        pending: PendingPush,
        code: grpc.StatusCode | None,
        details: str,
        refusal: Refusal = Refusal.UNSPECIFIED,
    ) -> None:
        """Settle ``pending`` with an error naming its step, bucket and chunk (``refusal``: the reason, if any)."""
        bucket, chunk = pending.bucket % CHUNK_KEY_STRIDE, pending.bucket // CHUNK_KEY_STRIDE
        where = f"step {pending.step} bucket {bucket} chunk {chunk}"
        address = self.addresses[pending.shard]
        pending.result.set_exception(AggregationError(address, code, f"{where}: {details}", refusal))

    def _shard_down(self, shard: int, error: AggregationError) -> None:
        """Fail the pushes waiting for ``shard`` now, rather than each after its own retries."""
        for waiting in self.window.drain(shard):
            # The refusal travels on: a push failed because its host was dropped is absorbed like the first.
            details = f"not sent: an earlier push to this shard failed ({error.details})"
            self.fail(waiting, error.code, details, error.refusal)

    def _on_reply(self, call: Reply, pending: PendingPush) -> None:
        code = call.code()
        address = self.addresses[pending.shard]
        if code == grpc.StatusCode.UNIMPLEMENTED and isinstance(call, StreamedReply):
            # An aggregator from before PushPullStream: this shard's pushes go as unary calls from now on.
            transport = self.transports[pending.shard]
            if isinstance(transport, (PushStream, ShardConnections)):
                log.info("aggregator %s has no PushPullStream; sending its pushes as unary PushPull calls", address)
                self.transports[pending.shard] = self._unary[pending.shard]
                self._replaced.append(transport)  # closed with the rest: a push may be on its way into it
            self._transmit(pending)  # still holding its window slot; a failure settles it
            return
        if code == grpc.StatusCode.OK:
            received_at = time.perf_counter()
            try:
                mean = serde.mean_from_bytes(call.result(), len(pending.out))
                pending.arrays.decode(mean.tensor, pending.out)
            except Exception as error:  # whatever fails here must still settle the future
                pending.result.set_exception(AggregationError(address, None, str(error)))
                return
            self._stats.pulled(
                mean.wire_bytes,
                received_at - pending.sent_at,
                time.perf_counter() - received_at,
                mean.skipped,
                mean.partial,
            )
            if mean.skipped:
                log.warning("aggregator %s skipped step %d: a rank reported NaN/Inf gradients", address, pending.step)
            if mean.partial:
                log.warning(
                    "aggregator %s averaged %d ranks; missing %s", address, mean.contributors, list(mean.missing_ranks)
                )
            pending.result.set_result(pending.out.reshape(pending.shape))
        elif (
            code == grpc.StatusCode.ABORTED and pending.attempt < self.max_retries and self._lost_self(refusal_of(call))
        ):
            pending.attempt += 1  # back after a silence the aggregator took for a loss: rejoin, send again
            log.warning("aggregator %s counted this rank lost; rejoining: %s", address, call.details())
            timer = threading.Timer(0.0, self._retry, (pending,))
            timer.daemon = True
            timer.start()
        elif (
            code == grpc.StatusCode.FAILED_PRECONDITION
            and pending.attempt < self.max_retries
            and refusal_of(call) in (Refusal.UNKNOWN_JOB, Refusal.NOT_JOINED, Refusal.ANOTHER_RUN)
        ):
            # The aggregator restarted between two pushes (it was back before the next one, so the push was
            # refused, not unavailable): it holds no run of this job, or one another host started there without
            # this member (a run that never trained yields to this member's, which has). Rejoin and send again,
            # as after an outage; the Join is refused where the aggregator dropped this member (NOT_JOINED) or
            # runs a run that trained without it (ANOTHER_RUN), and that refusal is the push's.
            pending.attempt += 1
            log.warning("aggregator %s does not hold this member (restarted?); rejoining: %s", address, call.details())
            timer = threading.Timer(0.0, self._retry, (pending,))
            timer.daemon = True
            timer.start()
        elif code == grpc.StatusCode.UNAVAILABLE and pending.attempt < self.max_retries:
            if pending.unavailable_since is None:
                pending.unavailable_since = pending.sent_at
            if _closed_by_keepalive(call.details() or "") and pending.shard not in self._advised:
                self._advised.add(pending.shard)  # once per shard, not on every retry of every push
                log.warning("aggregator %s: %s", address, _KEEPALIVE_ADVICE)
            pending.attempt += 1
            delay = self.retry_backoff_s * 2 ** (pending.attempt - 1)
            log.info(
                "aggregator %s unavailable; retry %d/%d in %.2f s", address, pending.attempt, self.max_retries, delay
            )
            timer = threading.Timer(delay, self._retry, (pending,))
            timer.daemon = True
            timer.start()
        else:
            details = call.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE:
                details = self._unreachable(pending, details)
            failure = AggregationError(address, code, details, refusal_of(call))
            if code == grpc.StatusCode.UNAVAILABLE:
                self._shard_down(pending.shard, failure)
            pending.result.set_exception(failure)

    def _unreachable(self, pending: PendingPush, details: str) -> str:
        """What a push that ran out of patience says: unreachable, for how long, how often tried."""
        since = pending.unavailable_since if pending.unavailable_since is not None else pending.sent_at
        if _closed_by_keepalive(details):
            return f"{_KEEPALIVE_ADVICE} (last error: {details}; attempts: {pending.attempt + 1})"
        return (
            f"unreachable: tried for {time.perf_counter() - since:.1f} s ({pending.attempt + 1} attempts, "
            f"rejoining between them); is the aggregator running? last error: {details}"
        )

    def _retry(self, pending: PendingPush) -> None:
        # A restarted aggregator has forgotten the job: rejoin (idempotent; waits a
        # bounded time for the shard to come back), then resend the same push.
        if self.window.closed:
            self.fail(pending, grpc.StatusCode.CANCELLED, "the client closed while the push waited to retry")
            return
        try:
            self._rejoin(pending.shard)
        except (AggregationError, ValueError) as error:  # ValueError: the channel closed meanwhile
            if isinstance(error, AggregationError) and error.code != grpc.StatusCode.UNAVAILABLE and error.refusal:
                failure = error  # the rejoin was refused: its reason is the push's
            elif isinstance(error, AggregationError):
                failure = AggregationError(error.address, error.code, self._unreachable(pending, error.details))
            else:
                failure = AggregationError(self.addresses[pending.shard], grpc.StatusCode.CANCELLED, str(error))
            self._shard_down(pending.shard, failure)
            pending.result.set_exception(failure)
            return
        self._transmit(pending)  # still holding its window slot; a failure settles it
