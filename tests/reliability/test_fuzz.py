"""Malformed pushes to a real aggregator, as calls and on a stream: a proper status each, then exact rounds."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradq.client import WorkerClient
from gradq.proto.convert import tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantConfig, Scheme, codec_for, encode
from gradq.qcore.codecs.sparse import SMALLEST_CHUNK
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

# Every answer must be one of these: a rejection a person can act on, or a mean.
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
U64 = st.integers(0, 2**64 - 1)
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[AggregatorServer, grpc.Channel]]:
    server = AggregatorServer(
        RoundPolicy(round_timeout_s=0.5, max_bucket_elements=1 << 20),
        ServerOptions("127.0.0.1:0", grace_s=0.5, max_message_bytes=1 << 20),
    )
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    join = channel.unary_unary(
        "/gradq.v1.Aggregator/Join", pb.JoinRequest.SerializeToString, pb.JoinResponse.FromString
    )
    join(pb.JoinRequest(job_id="fuzz", rank=0, world_size=1), timeout=5)
    yield server, channel
    channel.close()
    server.stop()


def float32_bytes(values: list[float]) -> bytes:
    return np.array(values, "<f4").tobytes()


@st.composite
def tensors(draw: st.DrawFn) -> pb.QuantizedTensor:
    """Start from a valid tensor, then break any subset of its fields."""
    numel = draw(st.integers(0, 300))
    scheme = draw(st.sampled_from(list(Scheme)))
    chunk = draw(st.integers(1, 64))
    chunk = SMALLEST_CHUNK if codec_for(scheme).sparse else chunk  # a sparse chunk is at least that
    config = QuantConfig(scheme=scheme, bits=draw(st.integers(2, 8)), channel_size=chunk)
    message = tensor_to_proto(encode(np.random.default_rng(numel).normal(size=numel).astype(np.float32), config))
    special = st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e-45, 3e38])
    mutations = {
        "scheme": st.integers(0, 2**31 - 1),
        "bits": st.integers(0, 2**32 - 1),
        "numel": U64,
        "channel_size": U64,
        "scale": st.one_of(st.binary(max_size=64), st.lists(special, max_size=16).map(float32_bytes)),
        "zero_point": st.one_of(
            st.binary(max_size=64),
            st.lists(st.integers(-(2**31), 2**31 - 1), max_size=16).map(lambda v: np.array(v, "<i4").tobytes()),
        ),
        "payload": st.binary(max_size=600),
        "dtype": st.text(max_size=20),
    }
    for name in draw(st.sets(st.sampled_from(sorted(mutations)), max_size=3)):
        setattr(message, name, draw(mutations[name]))
    return message


@st.composite
def requests(draw: st.DrawFn, garbage: bool = True) -> bytes:
    """A serialized PushPullRequest with any of its fields broken; with ``garbage``, 1 in 20 is random bytes."""
    if garbage and draw(st.integers(0, 19)) == 0:
        return draw(st.binary(max_size=200))  # not a protobuf at all, or a truncated one
    request = pb.PushPullRequest(
        job_id=draw(st.sampled_from(["fuzz", "", "nobody", "x" * 300])),
        step=draw(st.one_of(st.integers(0, 5), U64)),
        bucket=draw(st.one_of(st.integers(0, 3), U64)),
        rank=draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1))),
    )
    if draw(st.integers(0, 9)):
        request.tensor.CopyFrom(draw(tensors()))
    return request.SerializeToString()


@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=requests())
def test_every_malformed_request_gets_a_proper_status(
    target: tuple[AggregatorServer, grpc.Channel], data: bytes
) -> None:
    _, channel = target
    push = channel.unary_unary("/gradq.v1.Aggregator/PushPull")
    try:
        push(data, timeout=5)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    assert code in EXPECTED, (code, details)
    if code != grpc.StatusCode.OK:
        assert details.isprintable() and 10 < len(details) < 600, details


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=st.lists(requests(garbage=False), min_size=1, max_size=20))
def test_every_malformed_push_on_a_stream_gets_its_own_proper_answer(
    target: tuple[AggregatorServer, grpc.Channel], batch: list[bytes]
) -> None:
    _, channel = target
    # Each message names itself: a PushPullRequest holding only a sequence, appended, sets that field.
    sent = [data + pb.PushPullRequest(sequence=index + 1).SerializeToString() for index, data in enumerate(batch)]
    call = channel.stream_stream("/gradq.v1.Aggregator/PushPullStream")(iter(sent), timeout=30)
    answered = []
    for data in call:  # the call itself must end OK: every refusal is an answer, the stream goes on
        answer = pb.PushPullResponse.FromString(data)
        answered.append(answer.sequence)
        code = STATUS_CODES[answer.code]
        assert code in EXPECTED, (code, answer.details)
        if code != grpc.StatusCode.OK:
            assert answer.details.isprintable() and 10 < len(answer.details) < 600, answer.details
            assert not answer.HasField("mean")
    assert sorted(answered) == list(range(1, len(sent) + 1))


def test_server_still_averages_exactly_after_the_fuzzing(target: tuple[AggregatorServer, grpc.Channel]) -> None:
    server, _ = target
    config = QuantConfig(scheme=Scheme.FLOAT32)
    with WorkerClient(f"127.0.0.1:{server.port}", "after-fuzz", 0, 1, config) as client:
        np.testing.assert_array_equal(client.push_pull(0, 0, np.arange(7, dtype=np.float32)), np.arange(7))
    assert server.table.in_flight() == 0
