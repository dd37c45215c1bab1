"""Duplicate and late pushes, rejoining workers, and a client whose deadline expires mid-round."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from gradq.proto.convert import tensor_from_proto, tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


@pytest.fixture
def stub() -> Iterator[tuple[AggregatorServer, pb_grpc.AggregatorStub]]:
    server = AggregatorServer(RoundPolicy(round_timeout_s=1.5), ServerOptions("127.0.0.1:0", grace_s=0.5))
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, pb_grpc.AggregatorStub(channel)
    server.stop()


def request(rank: int, value: float, step: int = 0) -> pb.PushPullRequest:
    tensor = tensor_to_proto(encode(np.full(5, value, np.float32), EXACT))
    return pb.PushPullRequest(job_id="j", step=step, bucket=0, rank=rank, tensor=tensor)


def join(stub: pb_grpc.AggregatorStub, *ranks: int) -> None:
    for rank in ranks:
        stub.Join(pb.JoinRequest(job_id="j", rank=rank, world_size=2), timeout=5)


def mean_of(response: pb.PushPullResponse) -> np.ndarray:
    return decode(tensor_from_proto(response.mean))


def test_expired_client_deadline_then_retry_gets_the_answer_counted_once(
    stub: tuple[AggregatorServer, pb_grpc.AggregatorStub],
) -> None:
    server, aggregator = stub
    join(aggregator, 0, 1)
    with pytest.raises(grpc.RpcError) as expired:
        aggregator.PushPull(request(0, 1.0), timeout=0.2)  # rank 1 is not there yet
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.table.in_flight() == 1  # the server still holds rank 0's contribution
    answer = aggregator.PushPull(request(1, 3.0), timeout=5)
    retry = aggregator.PushPull(request(0, 1.0), timeout=5)  # same (step, bucket, rank)
    for response in (answer, retry):
        np.testing.assert_array_equal(mean_of(response), np.full(5, 2.0, np.float32))
    assert server.table.counters["contributions"] == 2


def test_late_push_to_a_failed_round_gets_its_failure_not_a_new_round(
    stub: tuple[AggregatorServer, pb_grpc.AggregatorStub],
) -> None:
    server, aggregator = stub
    join(aggregator, 0, 1)
    with pytest.raises(grpc.RpcError) as failed:
        aggregator.PushPull(request(0, 1.0), timeout=5)
    assert failed.value.code() == grpc.StatusCode.ABORTED
    with pytest.raises(grpc.RpcError) as late:
        aggregator.PushPull(request(1, 3.0), timeout=5)
    assert late.value.code() == grpc.StatusCode.ABORTED and "ranks [1] missing" in (late.value.details() or "")
    assert server.table.in_flight() == 0


def test_worker_that_rejoins_is_counted_once(stub: tuple[AggregatorServer, pb_grpc.AggregatorStub]) -> None:
    server, aggregator = stub
    join(aggregator, 0, 1)
    pending = aggregator.PushPull.future(request(0, 1.0), timeout=5)
    join(aggregator, 1, 1)  # a restarted worker joins again (idempotent)
    assert aggregator.Join(pb.JoinRequest(job_id="j", rank=1, world_size=2), timeout=5).joined == 2
    response = aggregator.PushPull(request(1, 5.0), timeout=5)
    np.testing.assert_array_equal(mean_of(response), np.full(5, 3.0, np.float32))
    np.testing.assert_array_equal(mean_of(pending.result()), np.full(5, 3.0, np.float32))
    assert server.table.counters["contributions"] == 2
