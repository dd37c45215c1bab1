"""Sparse rounds on the aggregator: the mean re-sparsified with its own error feedback, exact against numpy.

Two members push sparse_topk pseudo-gradients with error feedback, as DiLoCo
hosts do; what comes back is checked bit for bit against the same arithmetic
done here by hand: each member's residual, the dense float32 sum of the decoded
pushes, and the aggregator's residual carrying what the mean's own top-k left.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from gradq.client import WorkerClient
from gradq.proto.convert import tensor_from_proto, tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import ErrorFeedback, QuantConfig, Scheme, decode, decode_accumulate, encode
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.job_spec import JobSpec
from gradq.server.policy import PushedGrid, RoundPolicy, feeds_back
from gradq.server.rounds import RoundTable

SPARSE = QuantConfig(Scheme.SPARSE_TOPK, channel_size=256, topk=8)
NUMEL = 256 * 20 + 100  # a short last chunk too


@pytest.fixture(scope="module")
def server() -> Iterator[AggregatorServer]:
    aggregator = AggregatorServer(RoundPolicy(round_timeout_s=20.0), ServerOptions("127.0.0.1:0", grace_s=0.5))
    aggregator.start()
    yield aggregator
    aggregator.stop()


def pseudo_gradients(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    shared = rng.standard_normal(NUMEL).astype(np.float32)
    return [shared + rng.standard_normal(NUMEL).astype(np.float32) for _ in range(2)]


def test_the_mean_is_resparsified_with_the_aggregators_error_feedback_exactly(server: AggregatorServer) -> None:
    address = f"127.0.0.1:{server.port}"
    members = [WorkerClient(address, "sparse-exact", rank, 2, SPARSE, error_feedback=True) for rank in range(2)]
    hosts, aggregator = [ErrorFeedback(), ErrorFeedback()], ErrorFeedback()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda member: member.join(), members))
        try:
            for step in range(6):
                values = pseudo_gradients(step)
                answers = [
                    future.result(timeout=30)
                    for future in [pool.submit(m.push_pull, step, 0, v) for m, v in zip(members, values, strict=True)]
                ]
                # By hand: each host's compensated push; the sum (two terms: the same in either order); the mean.
                pushes = [feedback.encode(0, v, SPARSE) for feedback, v in zip(hosts, values, strict=True)]
                total = np.zeros(NUMEL, np.float32)
                decode_accumulate(pushes[0], total)
                decode_accumulate(pushes[1], total, divide_by=2)
                mean = aggregator.encode(0, total, SPARSE)
                expected = decode(mean)
                for answer in answers:
                    assert np.array_equal(answer, expected), step
                # What comes back is as sparse as what went up: at most topk per chunk.
                assert np.count_nonzero(expected) <= SPARSE.topk * 21
                assert mean.nbytes == pushes[0].nbytes
        finally:
            for member in members:
                member.close()


def raw_push(stub: pb_grpc.AggregatorStub, rank: int, tensor: pb.QuantizedTensor) -> pb.PushPullResponse:
    request = pb.PushPullRequest(job_id="sparse-raw", step=0, bucket=0, rank=rank, tensor=tensor)
    return stub.PushPull(request, timeout=30)


def test_a_resend_counts_once_and_a_hostile_push_is_refused_without_touching_the_round(
    server: AggregatorServer,
) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.AggregatorStub(channel)
    try:
        for rank in range(2):
            stub.Join(pb.JoinRequest(job_id="sparse-raw", rank=rank, world_size=2), timeout=30)
        values = pseudo_gradients(100)
        pushes = [encode(v, SPARSE) for v in values]
        # Indices out of order in chunk 0: refused by name, and the round goes on for everyone else.
        hostile = tensor_to_proto(pushes[1])
        payload = bytearray(hostile.payload)
        counts_end = (21 + 7) // 8  # every chunk full: flags only
        payload[counts_end], payload[counts_end + 1] = 0xFF, 0xFF  # the first index becomes 255, above the next
        hostile.payload = bytes(payload)
        with pytest.raises(grpc.RpcError) as caught:
            raw_push(stub, 1, hostile)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not follow the one before it" in str(caught.value.details())
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(raw_push, stub, 0, tensor_to_proto(pushes[0]))
            resent = pool.submit(raw_push, stub, 0, tensor_to_proto(pushes[0]))  # a retry of the same push
            other = pool.submit(raw_push, stub, 1, tensor_to_proto(pushes[1]))
            answers = [future.result(timeout=30) for future in (first, resent, other)]
        total = np.zeros(NUMEL, np.float32)
        decode_accumulate(pushes[0], total)
        decode_accumulate(pushes[1], total, divide_by=2)
        expected = decode(ErrorFeedback().encode(0, total, SPARSE))
        for answer in answers:
            assert answer.contributors == 2  # the resend is not a third contribution
            assert np.array_equal(decode(tensor_from_proto(answer.mean)), expected)
    finally:
        channel.close()


def test_the_aggregators_residual_is_charged_to_the_job() -> None:
    assert feeds_back(RoundPolicy(), PushedGrid(SPARSE.scheme, 2, SPARSE.channel_size, NUMEL, "float32", SPARSE.topk))
    # Even when server error feedback is left to its default for dense grids, a sparse return keeps one.
    assert not feeds_back(RoundPolicy(server_error_feedback=False), PushedGrid(SPARSE.scheme, 2, 256, NUMEL, "f"))
    table = RoundTable(RoundPolicy(round_timeout_s=5.0))
    for rank in range(2):
        table.join(JobSpec("job", rank, 2))
    before = table.budget.in_use
    tickets = []
    for rank, values in enumerate(pseudo_gradients(7)):
        tensor = encode(values, SPARSE)
        ticket = table.admit("job", 0, 0, rank, tensor)
        table.add(ticket, tensor)
        tickets.append(ticket)
    result = table.answer(tickets[0])
    assert result.encoded is not None and result.encoded.topk == SPARSE.topk
    with table.jobs.lock:
        job = table.jobs.current("job")
    assert job is not None
    residual = job.error_feedback.residual(0)
    assert residual is not None and residual.size == NUMEL and np.count_nonzero(residual) > 0  # the union's rest
    # The residual (4 bytes per element) stays charged after the round, as long as the job holds it.
    assert table.budget.in_use - before >= 4 * NUMEL
