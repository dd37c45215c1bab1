"""The payload fast path writes and reads exactly what protobuf itself would."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.proto.convert import parse_with_tensor, serialize_with_tensor, tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.wire import scalar_fields, split_bulk
from gradq.qcore import QuantConfig, Scheme, encode

PAYLOAD = pb.QuantizedTensor.DESCRIPTOR.fields_by_name["payload"].number
TENSOR = pb.PushPullRequest.DESCRIPTOR.fields_by_name["tensor"].number

requests: st.SearchStrategy[dict[str, object]] = st.builds(
    dict,
    job_id=st.text(max_size=40),
    step=st.integers(0, 2**64 - 1),
    bucket=st.integers(0, 2**64 - 1),
    rank=st.integers(0, 2**32 - 1),
    non_finite=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(
    fields=requests,
    numel=st.integers(0, 5000),
    bits=st.integers(1, 8),
    scheme=st.sampled_from([Scheme.PER_TENSOR_AFFINE, Scheme.PER_CHANNEL_AFFINE, Scheme.FLOAT32]),
)
def test_spliced_request_is_the_protobuf_message(fields: dict[str, Any], numel: int, bits: int, scheme: Scheme) -> None:
    config = QuantConfig(scheme=scheme, bits=bits, channel_size=64)
    tensor = encode(np.random.default_rng(numel).normal(size=numel).astype(np.float32), config)
    spliced = serialize_with_tensor(pb.PushPullRequest(**fields), "tensor", tensor)
    expected = pb.PushPullRequest(**fields, tensor=tensor_to_proto(tensor))
    assert pb.PushPullRequest.FromString(spliced) == expected
    # Read back by the fast path and from protobuf's own canonical bytes alike.
    for data in (spliced, expected.SerializeToString()):
        message, payload = parse_with_tensor(data, pb.PushPullRequest, "tensor")
        assert bytes(payload) == expected.tensor.payload
        message.tensor.payload = bytes(payload)
        assert message == expected


def test_payload_is_a_view_not_a_copy() -> None:
    tensor = encode(np.ones(1 << 16, np.float32), QuantConfig(bits=8))
    data = serialize_with_tensor(pb.PushPullRequest(job_id="j"), "tensor", tensor)
    split = split_bulk(data, TENSOR, PAYLOAD)
    assert split is not None
    stripped, payload = split
    assert isinstance(payload, memoryview) and payload.obj is data
    assert len(stripped) < 2000 and payload.nbytes == 1 << 16  # qparams of 128 channels stay


def test_repeated_tensor_field_falls_back_to_protobuf_merge() -> None:
    # Two occurrences of a message field merge; the fast path leaves that to protobuf.
    first = pb.PushPullRequest(tensor=pb.QuantizedTensor(payload=b"ab", numel=2)).SerializeToString()
    second = pb.PushPullRequest(tensor=pb.QuantizedTensor(bits=8)).SerializeToString()
    assert split_bulk(first + second, TENSOR, PAYLOAD) is None
    message, payload = parse_with_tensor(first + second, pb.PushPullRequest, "tensor")
    assert (payload, message.tensor.numel, message.tensor.bits) == (b"ab", 2, 8)


def test_wrong_wire_type_for_the_payload_falls_back() -> None:
    nested = bytes([PAYLOAD << 3 | 0, 5])  # payload sent as a varint: not a bytes field
    data = bytes([TENSOR << 3 | 2, len(nested)]) + nested
    assert split_bulk(data, TENSOR, PAYLOAD) is None


@pytest.mark.parametrize(
    "data",
    [
        bytes.fromhex("2a838080808080808080003a0141"),  # the tensor's length in 10 bytes
        bytes.fromhex("aa8080808000033a0141"),  # the tensor's tag in 6 bytes
        bytes.fromhex("2a08ba80808080000141"),  # the payload's tag in 6 bytes
    ],
    ids=["long-length", "long-tag", "long-payload-tag"],
)
def test_over_long_tags_and_lengths_are_refused_like_protobuf_does(data: bytes) -> None:
    assert split_bulk(data, TENSOR, PAYLOAD) is None
    with pytest.raises(DecodeError):
        parse_with_tensor(data, pb.PushPullRequest, "tensor")


@pytest.mark.parametrize("cut", [1, 5, 40])
def test_truncated_message_gets_protobufs_error(cut: int) -> None:
    tensor = encode(np.ones(64, np.float32), QuantConfig(bits=8))
    data = serialize_with_tensor(pb.PushPullRequest(job_id="j"), "tensor", tensor)
    assert split_bulk(data[:-cut], TENSOR, PAYLOAD) is None
    with pytest.raises(DecodeError):
        parse_with_tensor(data[:-cut], pb.PushPullRequest, "tensor")


def test_a_tensor_already_set_is_refused_rather_than_merged() -> None:
    tensor = encode(np.ones(8, np.float32), QuantConfig(bits=8))
    with pytest.raises(ValueError, match="tensor is already set on the PushPullRequest"):
        serialize_with_tensor(pb.PushPullRequest(tensor=pb.QuantizedTensor(bits=8)), "tensor", tensor)


@settings(max_examples=100, deadline=None)
@given(fields=requests, incarnation=st.text(max_size=40), numel=st.integers(0, 3000))
def test_scalar_fields_read_what_protobuf_reads_past_the_tensor(
    fields: dict[str, Any], incarnation: str, numel: int
) -> None:
    tensor = encode(np.ones(numel, np.float32), QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=4))
    data = serialize_with_tensor(pb.PushPullRequest(**fields, incarnation=incarnation), "tensor", tensor)
    numbers = {name: pb.PushPullRequest.DESCRIPTOR.fields_by_name[name].number for name in ("step", "incarnation")}
    found = scalar_fields(data, frozenset(numbers.values()))
    parsed = pb.PushPullRequest.FromString(data)
    assert found.get(numbers["step"], 0) == parsed.step
    assert found.get(numbers["incarnation"], b"") == parsed.incarnation.encode()


def test_a_repeated_scalar_field_keeps_its_last_value_as_protobuf_does() -> None:
    data = pb.PushPullRequest(step=1).SerializeToString() + pb.PushPullRequest(step=2**40).SerializeToString()
    assert pb.PushPullRequest.FromString(data).step == 2**40
    assert scalar_fields(data, frozenset({2})) == {2: 2**40}


@pytest.mark.parametrize("data", [b"\x10", b"\x3a\x05ab", b"\x15\x00\x00\x00\x00"])
def test_truncated_or_mistyped_fields_raise(data: bytes) -> None:
    with pytest.raises(IndexError):
        scalar_fields(data, frozenset({2, 7}))
