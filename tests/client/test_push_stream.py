"""The client's pushes on a PushPullStream: against real aggregators the same means, deadlines, close, old servers;
against a scripted call, which push each answer settles (by its sequence, or by its round)."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from gradq.client import AggregationError, WorkerClient, serde
from gradq.client.push_stream import PushStream, StreamedReply
from gradq.client.sending import UnaryPushes
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server import servicer
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

INT4 = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=4, channel_size=64)


def gradient(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).normal(0, 1e-2, 4096).astype(np.float32)


def test_a_streamed_rank_and_a_unary_rank_get_the_same_means_every_step(aggregator: AggregatorServer) -> None:
    address = f"127.0.0.1:{aggregator.port}"
    clients = [
        WorkerClient(address, "mixed", rank, 2, INT4, error_feedback=True, push_stream=rank == 0) for rank in range(2)
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(WorkerClient.join, clients))
        for step in range(5):
            # Two buckets a step, each rank's pushed at once: answers may come in any order.
            futures = [
                [client.push_pull_async(step, bucket, gradient(rank * 2 + bucket, step)) for bucket in range(2)]
                for rank, client in enumerate(clients)
            ]
            streamed, unary = ([future.result(timeout=30) for future in per_rank] for per_rank in futures)
            for a, b in zip(streamed, unary, strict=True):
                np.testing.assert_array_equal(a, b)
    assert all(isinstance(t, PushStream) for t in clients[0]._sender.transports[0].transports)  # type: ignore[attr-defined]
    assert all(isinstance(t, UnaryPushes) for t in clients[1]._sender.transports[0].transports)  # type: ignore[attr-defined]
    assert aggregator.table.counters["contributions"] == 2 * 2 * 5
    for client in clients:
        client.close()


def test_a_push_not_answered_in_time_fails_and_the_next_one_is_answered(aggregator: AggregatorServer) -> None:
    address = f"127.0.0.1:{aggregator.port}"
    late = WorkerClient(address, "late", 0, 2, INT4, timeout_s=0.5, max_retries=0)
    other = WorkerClient(address, "late", 1, 2, INT4)
    late.join()
    other.join()
    with pytest.raises(AggregationError, match=r"aggregator 127.0.0.1:\d+: DEADLINE_EXCEEDED: no answer within 0.5 s"):
        late.push_pull(0, 0, gradient(0, 0))
    # Its push stayed counted: rank 1 completes the round, and rank 0's late answer is dropped unread.
    other.push_pull(0, 0, gradient(1, 0))
    assert aggregator.table.counters["contributions"] == 2
    # The stream goes on: both ranks get step 1's mean.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        means = list(pool.map(lambda rank: (late, other)[rank].push_pull(1, 0, gradient(rank, 1)), range(2)))
    np.testing.assert_array_equal(means[0], means[1])
    assert aggregator.table.counters["contributions"] == 4
    late.close()
    other.close()


def test_close_fails_a_waiting_streamed_push_at_once(aggregator: AggregatorServer) -> None:
    client = WorkerClient(f"127.0.0.1:{aggregator.port}", "closing", 0, 2, INT4)
    client.join()
    waiting = client.push_pull_async(0, 0, gradient(0, 0))
    client.close()
    with pytest.raises(AggregationError) as raised:
        waiting.result(timeout=10)
    # ABORTED when the round's failure (close leaves the job first) is answered before the call is cancelled.
    assert raised.value.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)
    with pytest.raises(AggregationError, match="closed"):
        client.push_pull_async(1, 0, gradient(0, 1)).result(timeout=10)


def test_an_aggregator_without_push_stream_gets_unary_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def without_stream(servicer_: servicer.AggregatorServicer) -> dict[str, grpc.RpcMethodHandler]:
        handlers = real(servicer_)
        del handlers["PushPullStream"]
        return handlers

    real = servicer.aggregator_handlers
    monkeypatch.setattr(servicer, "aggregator_handlers", without_stream)
    old = AggregatorServer(RoundPolicy(round_timeout_s=60.0), ServerOptions("127.0.0.1:0", grace_s=0.5))
    old.start()
    try:
        with WorkerClient(f"127.0.0.1:{old.port}", "old", 0, 1, QuantConfig(scheme=Scheme.FLOAT32)) as client:
            for step in range(3):
                values = gradient(0, step)
                np.testing.assert_array_equal(client.push_pull(step, 0, values), values)
            assert isinstance(client._sender.transports[0], UnaryPushes)
    finally:
        old.stop()


class _ScriptedCall:
    """A PushPullStream call whose answers the test writes: iterating it yields them until ``end``."""

    def __init__(self, requests: Iterator[bytes]) -> None:
        self.requests = requests
        self._answers: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def answer(self, data: bytes) -> None:
        self._answers.put(data)

    def end(self) -> None:
        self._answers.put(None)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._answers.get, None)

    def cancel(self) -> None:
        self.end()


def _scripted(timeout_s: float) -> tuple[PushStream, list[_ScriptedCall]]:
    """A PushStream whose calls are scripted; the list holds each call it opened."""
    calls: list[_ScriptedCall] = []

    def start(requests: Iterator[bytes]) -> _ScriptedCall:
        calls.append(_ScriptedCall(requests))
        return calls[-1]

    return PushStream(start, timeout_s), calls


def _push(step: int, bucket: int, sequence: int, incarnation: str = "run") -> bytes:
    tensor = encode(np.zeros(4, np.float32), QuantConfig(scheme=Scheme.FLOAT32))
    return serde.push_pull_request("job", step, bucket, 0, tensor, incarnation=incarnation, sequence=sequence)


def _round_answer(step: int, bucket: int, incarnation: str = "run") -> bytes:
    return pb.PushPullResponse(step=step, bucket=bucket, incarnation=incarnation, contributors=2).SerializeToString()


def test_a_rounds_shared_answer_settles_its_oldest_unanswered_push_and_a_sequence_names_its_own() -> None:
    stream, calls = _scripted(timeout_s=30)
    first, second, other = (stream.send(_push(*push), push[2]) for push in ((5, 0, 1), (5, 0, 2), (5, 1, 3)))
    call = calls[0]
    call.answer(_round_answer(5, 1))
    call.answer(_round_answer(5, 0))
    call.answer(pb.PushPullResponse(sequence=2, code=grpc.StatusCode.ABORTED.value[0]).SerializeToString())
    for reply in (first, second, other):
        _wait_settled(reply)
    assert (first.code(), other.code()) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
    assert second.code() == grpc.StatusCode.ABORTED
    assert first.result() == _round_answer(5, 0) and other.result() == _round_answer(5, 1)
    # An answer naming a round this client has no unanswered push of (another run's) settles nothing.
    late = stream.send(_push(6, 0, 4), 4)
    call.answer(_round_answer(6, 0, incarnation="an older run"))
    call.answer(_round_answer(6, 0))
    _wait_settled(late)
    assert late.code() == grpc.StatusCode.OK
    stream.close()


def test_a_push_past_its_deadline_is_forgotten_by_its_round() -> None:
    stream, calls = _scripted(timeout_s=0.2)
    expired = stream.send(_push(7, 0, 1), 1)
    _wait_settled(expired)
    assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream.timeout_s = 30
    resent = stream.send(_push(7, 0, 2), 2)
    calls[0].answer(_round_answer(7, 0))  # the round's answer: the resent push is its only unanswered one
    _wait_settled(resent)
    assert resent.code() == grpc.StatusCode.OK and resent.result() == _round_answer(7, 0)
    stream.close()


def _wait_settled(reply: StreamedReply) -> None:
    settled = threading.Event()
    reply.add_done_callback(lambda _: settled.set())
    assert settled.wait(10), "the push was not settled"
