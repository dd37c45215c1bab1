"""Weighted means (JoinRequest.weighted) over real gRPC: sum(weight * values) / sum(weight), and bad weights refused.

DiLoCo's token-weighted rounds use them (tests/client/test_diloco_weights.py
runs real hosts); here members push by hand, raw or through WorkerClient.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from gradq.client import JobSpec, WorkerClient
from gradq.proto.convert import tensor_from_proto, tensor_to_proto
from gradq.proto.transport import MAX_PUSH_WEIGHT
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy
from gradq.server.semi_sync import LateStash

StartAggregator = Callable[..., AggregatorServer]
Stub = pb_grpc.AggregatorStub
FP32 = QuantConfig(Scheme.FLOAT32)
INT4 = QuantConfig(Scheme.PER_CHANNEL_AFFINE, bits=4, channel_size=64)


@pytest.fixture(scope="module")
def exact_server() -> Iterator[AggregatorServer]:
    server = AggregatorServer(
        RoundPolicy(round_timeout_s=20.0, return_scheme=Scheme.FLOAT32), ServerOptions("127.0.0.1:0", grace_s=0.5)
    )
    server.start()
    yield server
    server.stop()


def clients(server: AggregatorServer, job: str, ranks: list[int], config: QuantConfig = FP32) -> list[WorkerClient]:
    """One weighted client per member, member i standing for ``ranks[i]`` ranks; all joined."""
    made = [
        WorkerClient(
            f"127.0.0.1:{server.port}",
            job,
            member,
            JobSpec(world_size=len(ranks), ranks=count, job_ranks=sum(ranks), weighted=True),
            config,
            timeout_s=20.0,
        )
        for member, count in enumerate(ranks)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(made)) as pool:
        list(pool.map(lambda client: client.join(), made))
    return made


def round_trip(members: list[WorkerClient], values: list[np.ndarray], weights: list[int], step: int = 0) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
        futures = [
            pool.submit(client.push_pull, step, 0, array, weight=weight)
            for client, array, weight in zip(members, values, weights, strict=True)
        ]
        return [future.result(timeout=30) for future in futures]


def test_the_mean_is_each_push_times_its_weight_over_the_sum_of_the_weights(exact_server: AggregatorServer) -> None:
    rng = np.random.default_rng(0)
    values = [rng.normal(size=1000).astype(np.float32) for _ in range(3)]
    weights = [1, 3, 1000]
    members = clients(exact_server, "weighted-fp32", [1, 1, 1])
    try:
        means = round_trip(members, values, weights)
        expected = sum(np.float32(w) * v for w, v in zip(weights, values, strict=True)) / np.float32(sum(weights))
        plain = sum(values) / np.float32(3)
        for mean in means:
            np.testing.assert_allclose(mean, expected, rtol=1e-6, atol=1e-7)
            assert np.abs(mean - plain).max() > 0.1  # not the unweighted mean
        assert all(np.array_equal(means[0], mean) for mean in means[1:])
        # The next round weighs again, by its own weights.
        means = round_trip(members, values, [5, 5, 5], step=1)
        np.testing.assert_allclose(means[0], plain, rtol=1e-6, atol=1e-7)
    finally:
        for client in members:
            client.close()


def test_a_member_of_several_ranks_pushes_their_sum_and_its_weight_stands_for_the_whole_host(
    exact_server: AggregatorServer,
) -> None:
    rng = np.random.default_rng(1)
    host_sum, alone = rng.normal(size=256).astype(np.float32), rng.normal(size=256).astype(np.float32)
    members = clients(exact_server, "weighted-two-level", [2, 1])
    try:
        means = round_trip(members, [host_sum, alone], [6, 2])
        # The host of 2 ranks pushed their sum; its 6 tokens weigh its ranks' mean (the sum over 2).
        expected = (np.float32(6) * (host_sum / 2) + np.float32(2) * alone) / np.float32(8)
        for mean in means:
            np.testing.assert_allclose(mean, expected, rtol=1e-6, atol=1e-7)
    finally:
        for client in members:
            client.close()


def test_quantized_pushes_are_weighted_by_their_scales(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=20.0, return_scheme=Scheme.FLOAT32))
    rng = np.random.default_rng(2)
    values = [rng.normal(size=4096).astype(np.float32) for _ in range(2)]
    members = clients(server, "weighted-int4", [1, 1], INT4)
    try:
        means = round_trip(members, values, [1, 7])
        received = [decode(encode(v, INT4)) for v in values]  # what the aggregator decodes of each
        expected = (received[0] + np.float32(7) * received[1]) / np.float32(8)
        np.testing.assert_allclose(means[0], expected, rtol=1e-5, atol=1e-6)
    finally:
        for client in members:
            client.close()


def raw_push(job: str, rank: int, weight: int, step: int = 0) -> pb.PushPullRequest:
    tensor = tensor_to_proto(encode(np.ones(8, np.float32), FP32))
    return pb.PushPullRequest(job_id=job, step=step, bucket=0, rank=rank, tensor=tensor, weight=weight)


def test_bad_weights_are_refused_by_name_and_leave_the_round_to_the_others(
    start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=20.0, return_scheme=Scheme.FLOAT32))
    stub = stub_for(server)
    for rank in range(2):
        stub.Join(pb.JoinRequest(job_id="w", rank=rank, world_size=2, weighted=True), timeout=5)
        stub.Join(pb.JoinRequest(job_id="plain", rank=rank, world_size=2), timeout=5)
    refusals = [
        ("w", 0, "weight=0 is invalid; expected 1..1099511627776"),
        ("w", MAX_PUSH_WEIGHT + 1, f"weight={MAX_PUSH_WEIGHT + 1} is invalid; expected 1..{MAX_PUSH_WEIGHT}"),
        ("plain", 3, "weight=3 is invalid; expected 0 in job 'plain'"),
    ]
    for job, weight, message in refusals:
        with pytest.raises(grpc.RpcError) as refused:
            stub.PushPull(raw_push(job, 0, weight), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in refused.value.details()
    # A Join that disagrees about weighting is refused, naming it; the job's members are untouched.
    with pytest.raises(grpc.RpcError) as refused:
        stub.Join(pb.JoinRequest(job_id="w", rank=1, world_size=2, weighted=False), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "weighted=False does not match job 'w'" in refused.value.details()
    # Nothing was counted: both jobs' rounds complete with the members' good pushes.
    for job, weights in (("w", (2, 6)), ("plain", (0, 0))):
        other = stub.PushPull.future(raw_push(job, 1, weights[1]), timeout=10)
        mine = stub.PushPull(raw_push(job, 0, weights[0]), timeout=10)
        for response in (mine, other.result()):
            assert response.contributors == 2
            np.testing.assert_array_equal(decode(tensor_from_proto(response.mean)), np.ones(8, np.float32))


def test_a_resend_with_another_weight_is_refused_not_counted_again(
    start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=20.0, return_scheme=Scheme.FLOAT32))
    stub = stub_for(server)
    for rank in range(2):
        stub.Join(pb.JoinRequest(job_id="resend", rank=rank, world_size=2, weighted=True), timeout=5)
    first = stub.PushPull.future(raw_push("resend", 0, 4), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        stub.PushPull(raw_push("resend", 0, 5), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already counted a different bucket from rank=0" in refused.value.details()
    stub.PushPull(raw_push("resend", 1, 4), timeout=10)
    assert first.result().contributors == 2


def test_a_weighted_client_refuses_a_push_without_a_weight_before_sending(exact_server: AggregatorServer) -> None:
    members = clients(exact_server, "weighted-client-check", [1])
    try:
        with pytest.raises(ValueError, match=r"weight=0 is invalid; expected an integer in 1\.\.1099511627776"):
            members[0].push_pull(0, 0, np.ones(4, np.float32))
        assert members[0].bytes_sent == 0
    finally:
        members[0].close()


def test_a_late_push_is_merged_by_its_weight() -> None:
    late = np.arange(1, 9, dtype=np.float32)
    stash = LateStash.first(encode(late, FP32), ranks=1, member=3, weight=6, times=6.0)
    mean = np.full(8, 2.0, np.float32)  # a round's mean over weight 2
    assert stash.merge_into(mean, 2) == 8
    np.testing.assert_allclose(mean, (np.float32(2) * 2 + np.float32(6) * late) / 8, rtol=1e-6)
