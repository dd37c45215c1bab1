"""The client's pushes on a PushPullStream against real aggregators: the same means, deadlines, close, old servers."""

from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import pytest

from gradq.client import AggregationError, WorkerClient
from gradq.client.push_stream import PushStream
from gradq.client.sending import UnaryPushes
from gradq.qcore import QuantConfig, Scheme
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
    assert isinstance(clients[0]._sender.transports[0], PushStream)
    assert isinstance(clients[1]._sender.transports[0], UnaryPushes)
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
