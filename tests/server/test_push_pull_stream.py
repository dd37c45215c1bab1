"""PushPullStream over real gRPC: pushes answered by sequence as rounds finish, refusals in-band, caps and stop kept."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from waiting import wait_until

from gradq.proto.convert import tensor_from_proto, tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy

Stub = pb_grpc.AggregatorStub
INT8 = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8, channel_size=4)
A = np.array([0, 255, 2, 100, -128, 127, -6, 0], np.float32)
B = np.array([0, 255, 8, 50, -128, 127, 4, 10], np.float32)  # with A: integer means on a grid of step 1


def request(
    rank: int, values: np.ndarray, bucket: int = 0, sequence: int = 0, job_id: str = "job"
) -> pb.PushPullRequest:
    tensor = tensor_to_proto(encode(values, INT8))
    return pb.PushPullRequest(job_id=job_id, step=0, bucket=bucket, rank=rank, tensor=tensor, sequence=sequence)


def join(stub: Stub, world_size: int) -> None:
    for rank in range(world_size):
        stub.Join(pb.JoinRequest(job_id="job", rank=rank, world_size=world_size), timeout=5)


def mean_of(response: pb.PushPullResponse) -> np.ndarray:
    return decode(tensor_from_proto(response.mean))


class Stream:
    """One PushPullStream call fed from a queue: send pushes one at a time, read answers as they come."""

    def __init__(self, stub: Stub) -> None:
        self._outbox: queue.SimpleQueue[pb.PushPullRequest | None] = queue.SimpleQueue()
        self.call = stub.PushPullStream(iter(self._outbox.get, None), timeout=30)
        self._answers: Iterator[pb.PushPullResponse] = iter(self.call)

    def send(self, push: pb.PushPullRequest) -> None:
        self._outbox.put(push)

    def next(self) -> pb.PushPullResponse:
        return next(self._answers)

    def rest(self) -> list[pb.PushPullResponse]:
        """The answers until the call ends; it must end OK."""
        return list(self._answers)

    def finish(self) -> list[pb.PushPullResponse]:
        """Half-close and read the answers left; the call must end OK."""
        self._outbox.put(None)
        return self.rest()


@pytest.fixture
def capped() -> Iterator[AggregatorServer]:
    """An aggregator that lets one client host have at most 2 pushes waiting."""
    limits = ServiceLimits(max_waiting_per_peer=2)
    server = AggregatorServer(RoundPolicy(round_timeout_s=60.0), ServerOptions("127.0.0.1:0", grace_s=0.5), limits)
    server.start()
    yield server
    server.stop()


def test_each_push_is_answered_by_sequence_as_its_round_finishes(
    aggregator: AggregatorServer, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    stub = stub_for(aggregator)
    join(stub, 2)
    stream = Stream(stub)
    stream.send(request(0, A, bucket=0, sequence=10))
    stream.send(request(0, A, bucket=1, sequence=11))
    # Rank 1 completes bucket 1 first: the stream answers it while bucket 0's round still waits.
    other_1 = stub.PushPull.future(request(1, B, bucket=1), timeout=10)
    first = stream.next()
    assert (first.sequence, first.code, first.contributors, first.partial) == (11, 0, 2, False)
    np.testing.assert_array_equal(mean_of(first), (A + B) / 2)
    other_0 = stub.PushPull.future(request(1, B, bucket=0), timeout=10)
    second = stream.next()
    assert (second.sequence, second.code, second.contributors) == (10, 0, 2)
    # The stream's answer is the round's answer, with the sequence added: the same mean bytes.
    for unary, streamed in ((other_1.result(), first), (other_0.result(), second)):
        assert unary.mean == streamed.mean and not unary.sequence
    assert stream.finish() == []
    assert aggregator.servicer.waiting.count == 0


def test_a_push_that_takes_round_answers_gets_the_bytes_every_waiter_of_its_round_shares(
    aggregator: AggregatorServer, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    stub = stub_for(aggregator)
    join(stub, 3)
    streams, calls = [], []
    with grpc.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        raw = channel.stream_stream("/gradq.v1.Aggregator/PushPullStream")  # bytes both ways
        for rank in range(2):
            push = request(rank, (A, B)[rank], bucket=4, sequence=rank + 1)
            push.round_answers = True
            streams.append(queue.SimpleQueue[bytes | None]())
            streams[-1].put(push.SerializeToString())
            calls.append(raw(iter(streams[-1].get, None), timeout=30))
        unary = channel.unary_unary("/gradq.v1.Aggregator/PushPull")(request(2, A, bucket=4).SerializeToString())
        answers = [next(iter(call)) for call in calls]
        for outbox in streams:
            outbox.put(None)
    # No sequence: the round's own bytes, naming the round, the same for both and for the unary call.
    assert answers[0] == answers[1] == unary
    shared = pb.PushPullResponse.FromString(answers[0])
    assert (shared.sequence, shared.code, shared.step, shared.bucket, shared.incarnation) == (0, 0, 0, 4, "")
    assert shared.contributors == 3 and mean_of(shared).shape == A.shape
    wait_until(lambda: aggregator.servicer.waiting.count == 0, "the answered pushes' waiting slots given back")


def test_a_refused_push_is_answered_in_band_and_the_stream_goes_on(
    aggregator: AggregatorServer, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    stub = stub_for(aggregator)
    join(stub, 1)
    stream = Stream(stub)
    bad = request(0, A, sequence=1)
    bad.tensor.bits = 9
    stream.send(bad)
    stream.send(request(0, A, sequence=2, job_id="nobody-joined-this"))
    stream.send(request(0, A, sequence=3))
    answers = {answer.sequence: answer for answer in stream.finish()}
    assert set(answers) == {1, 2, 3}
    assert answers[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "tensor.bits=9 is invalid" in answers[1].details and not answers[1].HasField("mean")
    assert answers[2].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "nobody-joined-this" in answers[2].details
    assert (answers[3].code, answers[3].details, answers[3].contributors) == (0, "", 1)
    np.testing.assert_array_equal(mean_of(answers[3]), A)


def test_bytes_that_are_no_push_end_the_stream_with_invalid_argument(aggregator: AggregatorServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = channel.stream_stream("/gradq.v1.Aggregator/PushPullStream")(iter([b"\xff\xff\xff"]), timeout=10)
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a gradq.v1.PushPullRequest" in (raised.value.details() or "")


def test_pushes_past_the_peer_cap_are_refused_and_a_cancelled_stream_gives_its_slots_back(
    capped: AggregatorServer, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    stub = stub_for(capped)
    join(stub, 2)
    stream = Stream(stub)
    for bucket in range(3):
        stream.send(request(0, A, bucket=bucket, sequence=bucket + 1))
    refused = stream.next()  # buckets 0 and 1 wait for rank 1; the third finds the cap full
    assert refused.sequence == 3 and refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "--max-waiting-per-peer=2" in refused.details
    assert capped.servicer.waiting.count == 2
    stream.call.cancel()
    wait_until(lambda: capped.servicer.waiting.count == 0, "the cancelled stream's waiting slots given back")
    # Its pushes stay counted, as a cancelled PushPull's do: rank 1 completes both rounds.
    for bucket in range(2):
        answer = stub.PushPull(request(1, B, bucket=bucket), timeout=10)
        assert answer.contributors == 2 and not answer.partial
        np.testing.assert_array_equal(mean_of(answer), (A + B) / 2)


def test_a_stopping_server_ends_an_idle_stream_cleanly() -> None:
    server = AggregatorServer(RoundPolicy(round_timeout_s=60.0), ServerOptions("127.0.0.1:0", grace_s=30.0))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AggregatorStub(channel)
            join(stub, 1)
            stream = Stream(stub)
            stream.send(request(0, A, sequence=7))
            assert stream.next().sequence == 7
            stopping = threading.Thread(target=server.stop)
            stopping.start()
            # Nothing unanswered: the stream ends OK at once, not cancelled when the stop runs out of patience.
            assert stream.rest() == []
            assert stream.call.code() == grpc.StatusCode.OK
            stopping.join(timeout=30)
            assert not stopping.is_alive()
    finally:
        server.stop()
