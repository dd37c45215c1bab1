"""The aggregator over real gRPC: bad input gets a status a person can act on, good rounds stay exact."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from waiting import wait_until

from gradq.proto.convert import tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.app import SERVICE_NAME, AggregatorServer, ServerOptions
from gradq.server.limits import ServiceLimits
from gradq.server.liveness import Liveness
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable
from gradq.server.servicer import AggregatorServicer, aggregator_handlers
from gradq.server.waiting import WaitingCalls

StartAggregator = Callable[..., AggregatorServer]

Stub = pb_grpc.AggregatorStub
INT8 = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8, channel_size=4)


def push(
    stub: Stub,
    rank: int,
    values: np.ndarray,
    step: int = 0,
    bucket: int = 0,
    fields: dict[str, object] | None = None,
) -> pb.PushPullRequest:
    tensor = tensor_to_proto(encode(values, INT8))
    for name, value in (fields or {}).items():
        setattr(tensor, name, value)
    return pb.PushPullRequest(job_id="job", step=step, bucket=bucket, rank=rank, tensor=tensor)


def join(stub: Stub, world_size: int) -> None:
    for rank in range(world_size):
        stub.Join(pb.JoinRequest(job_id="job", rank=rank, world_size=world_size), timeout=5)


def exact_round(stub: Stub, step: int) -> None:
    """Two ranks push integers on a grid of step 1 (each channel spans 255); the mean is exact."""
    a = np.array([0, 255, 2, 100, -128, 127, -6, 0], np.float32)
    b = np.array([0, 255, 8, 50, -128, 127, 4, 10], np.float32)
    other = stub.PushPull.future(push(stub, 1, b, step=step), timeout=10)
    mine = stub.PushPull(push(stub, 0, a, step=step), timeout=10)
    for response in (mine, other.result()):
        assert response.contributors == 2 and not response.partial
        np.testing.assert_array_equal(decode_mean(response), (a + b) / 2)


def decode_mean(response: pb.PushPullResponse) -> np.ndarray:
    from gradq.proto.convert import tensor_from_proto

    return decode(tensor_from_proto(response.mean))


BAD_TENSORS: list[tuple[str, dict[str, object], str]] = [
    ("payload length", {"payload": b"\x00" * 7}, "tensor.payload has 7 bytes; expected ceil(numel * bits / 8) = 8"),
    ("nan scale", {"scale": np.array([np.nan, 1], "<f4").tobytes()}, "tensor.scale[0]=nan is invalid"),
    ("zero scale", {"scale": np.array([1, 0], "<f4").tobytes()}, "tensor.scale[1]=0.0 is invalid"),
    ("negative scale", {"scale": np.array([-1, 1], "<f4").tobytes()}, "expected a finite number > 0"),
    (
        "zero point off grid",
        {"zero_point": np.array([0, 256], "<i4").tobytes()},
        "tensor.zero_point[1]=256 is off the grid; expected 0..255",
    ),
    ("unknown scheme", {"scheme": 42}, "tensor.scheme=42 is not a known scheme"),
    ("bits", {"bits": 9}, "tensor.bits=9 is invalid"),
    ("scale count", {"scale": b"\x00\x00\x80\x3f"}, "tensor.scale has 4 bytes; expected 8"),
]


@pytest.mark.parametrize(("name", "fields", "message"), BAD_TENSORS, ids=[case[0] for case in BAD_TENSORS])
def test_bad_tensor_is_invalid_argument_and_next_round_is_exact(
    start_aggregator: StartAggregator,
    stub_for: Callable[[AggregatorServer], Stub],
    name: str,
    fields: dict[str, object],
    message: str,
) -> None:
    server = start_aggregator()
    stub = stub_for(server)
    join(stub, 2)
    good = stub.PushPull.future(push(stub, 1, np.ones(8, np.float32)), timeout=10)  # a round in flight
    with pytest.raises(grpc.RpcError) as raised:
        stub.PushPull(push(stub, 0, np.ones(8, np.float32), fields=fields), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (raised.value.details() or "")
    stub.PushPull(push(stub, 0, np.full(8, 3.0, np.float32)), timeout=10)
    np.testing.assert_allclose(decode_mean(good.result()), np.full(8, 2.0), rtol=1e-6)
    exact_round(stub, step=1)


def test_round_state_errors_are_failed_precondition(
    start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=5.0, retain_steps=1))
    stub = stub_for(server)
    join(stub, 2)
    exact_round(stub, step=0)
    exact_round(stub, step=1)
    exact_round(stub, step=2)
    cases = [
        (push(stub, 0, np.ones(8, np.float32), step=0), "step=0 is stale"),
        (
            pb.PushPullRequest(job_id="nope", rank=0, tensor=push(stub, 0, np.ones(8)).tensor),
            "job 'nope' has no joined",
        ),
    ]
    unknown_rank = push(stub, 0, np.ones(8, np.float32), step=3)
    unknown_rank.rank = 5
    cases.append((unknown_rank, "rank=5 has not joined job 'job'"))
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as raised:
            stub.PushPull(request, timeout=10)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert message in (raised.value.details() or "")
    exact_round(stub, step=3)


def wait_for_round(server: AggregatorServer) -> None:
    wait_until(lambda: server.table.in_flight() > 0, "the first push to open its round")


def test_numel_mismatch_is_invalid_argument(
    start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    server = start_aggregator()
    stub = stub_for(server)
    join(stub, 2)
    pending = stub.PushPull.future(push(stub, 0, np.ones(8, np.float32)), timeout=10)
    wait_for_round(server)  # the 8-element push must open the round first
    with pytest.raises(grpc.RpcError) as raised:
        stub.PushPull(push(stub, 1, np.ones(12, np.float32)), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor.numel=12 does not match numel=8" in (raised.value.details() or "")
    stub.PushPull(push(stub, 1, np.ones(8, np.float32)), timeout=10)
    assert pending.result().contributors == 2


def test_missing_rank_fails_every_waiter_within_deadline(
    start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    stub = stub_for(start_aggregator(RoundPolicy(round_timeout_s=1.0)))
    join(stub, 3)
    waiters = [stub.PushPull.future(push(stub, rank, np.ones(8, np.float32)), timeout=5) for rank in (0, 2)]
    for waiter in waiters:
        error = waiter.exception(timeout=3)
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.ABORTED
        assert "ranks [1] missing" in (error.details() or "")


def test_join_errors(start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]) -> None:
    stub = stub_for(start_aggregator(RoundPolicy(world_size=2)))
    for request, code, message in [
        (pb.JoinRequest(job_id="j", rank=0, world_size=3), grpc.StatusCode.FAILED_PRECONDITION, "--world-size=2"),
        (pb.JoinRequest(job_id="j", rank=2, world_size=2), grpc.StatusCode.INVALID_ARGUMENT, "rank=2 is out of range"),
        (pb.JoinRequest(job_id="", rank=0, world_size=2), grpc.StatusCode.INVALID_ARGUMENT, "job_id=''"),
    ]:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Join(request, timeout=5)
        assert raised.value.code() == code and message in (raised.value.details() or "")
    response = stub.Join(pb.JoinRequest(job_id="j", rank=1, world_size=2), timeout=5)
    assert response.world_size == 2 and response.joined == 1 and response.server_id


def test_health_and_reflection_are_served(start_aggregator: StartAggregator) -> None:
    server = start_aggregator()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {service.name for reply in replies for service in reply.list_services_response.service}
        assert SERVICE_NAME in names and SERVICE_NAME == "gradq.v1.Aggregator"


def test_256_mb_bucket_goes_through(
    start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=60.0, return_scheme=Scheme.FLOAT32))
    stub = stub_for(server)
    numel = 64 * 1024 * 1024  # 256 MiB of fp32
    values = np.arange(numel, dtype=np.float32) % 251 - 125  # integer-valued: the 8-bit grid holds them
    stub.Join(pb.JoinRequest(job_id="big", rank=0, world_size=1), timeout=5)
    tensor = tensor_to_proto(encode(values, QuantConfig(scheme=Scheme.PER_TENSOR_AFFINE, bits=8)))
    response = stub.PushPull(pb.PushPullRequest(job_id="big", step=0, bucket=0, rank=0, tensor=tensor), timeout=120)
    mean = decode_mean(response)
    assert mean.size == numel
    np.testing.assert_allclose(mean[:1000], values[:1000], atol=0.5)
    del mean, response, tensor


def test_many_ranks_in_threads_get_identical_means(
    start_aggregator: StartAggregator, stub_for: Callable[[AggregatorServer], Stub]
) -> None:
    server = start_aggregator()
    stub = stub_for(server)
    world = 8
    join(stub, world)
    rng = np.random.default_rng(3)
    inputs = [rng.normal(size=5000).astype(np.float32) for _ in range(world)]
    answers: dict[int, np.ndarray] = {}

    def run(rank: int) -> None:
        answers[rank] = decode_mean(stub.PushPull(push(stub, rank, inputs[rank]), timeout=10))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert len(answers) == world
    for rank in range(1, world):
        np.testing.assert_array_equal(answers[rank], answers[0])
    assert server.table.counters["contributions"] == world


def test_decoded_push_matches_what_client_encoded() -> None:
    values = np.array([0, 255, 2, 100, -128, 127, -6, 0], np.float32)
    np.testing.assert_array_equal(decode(encode(values, INT8)), values)


def test_every_rpc_of_the_proto_has_a_handler() -> None:
    table = RoundTable(RoundPolicy())
    handlers = aggregator_handlers(
        AggregatorServicer(table, WaitingCalls(1, 1, 1), Liveness(table, ServiceLimits(), late_after_s=1.5))
    )
    # Shards answers the server's configuration, not round state: gradq.server.shard_group registers it beside these.
    assert set(handlers) | {"Shards"} == set(pb.DESCRIPTOR.services_by_name["Aggregator"].methods_by_name)


def test_watch_streams_are_refused_without_a_join_and_past_their_caps() -> None:
    limits = ServiceLimits(max_watches=2, max_world_size=4)
    server = AggregatorServer(RoundPolicy(round_timeout_s=5.0), ServerOptions("127.0.0.1:0", grace_s=0.5), limits)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.AggregatorStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Watch(iter([pb.WatchRequest(job_id="w", rank=0)]), timeout=5))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has no joined ranks; call Join first" in (refused.value.details() or "")
        stub.Join(pb.JoinRequest(job_id="w", rank=0, world_size=2), timeout=5)
        held = [stub.Watch(iter([pb.WatchRequest(job_id="w", rank=0)])) for _ in range(2)]
        assert [next(stream).joined for stream in held] == [1, 1]
        with pytest.raises(grpc.RpcError) as full:
            next(stub.Watch(iter([pb.WatchRequest(job_id="w", rank=0)]), timeout=5))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 Watch streams are open, this aggregator's limit (--max-watches)" in (full.value.details() or "")
        for stream in held:
            stream.cancel()
        # A watch that ends while its rank is still joined loses it: the next round fails at once.
        stub.Join(pb.JoinRequest(job_id="w", rank=1, world_size=2), timeout=5)
        wait_until(lambda: any(job.members.lost for job in server.table.jobs.all()), "rank 0 to be lost")
        tensor = tensor_to_proto(encode(np.ones(4, np.float32), QuantConfig()))
        request = pb.PushPullRequest(job_id="w", step=0, bucket=0, rank=1, tensor=tensor)
        with pytest.raises(grpc.RpcError) as lost:
            stub.PushPull(request, timeout=5)
        assert lost.value.code() == grpc.StatusCode.ABORTED
        assert "rank 0 was lost" in (lost.value.details() or "")
    finally:
        channel.close()
        server.stop()
