"""aggregator.proto's comments checked against the code they describe, wherever a test can read them.

The comments are the wire contract for anyone writing another client: each
scheme's bits and zero points against what its codec sends and accepts, the
``bucket`` key's layout against the client's chunk keys, and when ``partial``
is set against the rounds that set it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from gradq.client.chunks import CHUNK_KEY_STRIDE, chunk_key, shard_for
from gradq.client.elastic import STATE_CHUNK_BYTES
from gradq.proto.convert import tensor_to_proto
from gradq.proto.transport import MAX_STATE_CHUNK_BYTES
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantConfig, Scheme, codec_for, encode
from gradq.qcore.codecs import registered_schemes
from gradq.server.errors import FailedPreconditionError
from gradq.server.job_spec import JobSpec
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable, RoundTicket

PROTO = (Path(__file__).resolve().parents[2] / "proto" / "v1" / "aggregator.proto").read_text()


def comment_of(declaration: str) -> str:
    """The comment of the .proto line that starts with ``declaration``: the ``//`` lines above it plus its own."""
    lines = PROTO.splitlines()
    index = next(i for i, line in enumerate(lines) if line.strip().startswith(declaration))
    above: list[str] = []
    for line in reversed(lines[:index]):
        if not line.strip().startswith("//"):
            break
        above.insert(0, line.strip().removeprefix("//").strip())
    trailing = lines[index].partition("//")[2].strip()
    return " ".join([*above, trailing]).strip()


def scheme_comment(scheme: Scheme) -> str:
    return comment_of(f"SCHEME_{scheme.name} =")


def header(scheme: Scheme, bits: int, zero_points: np.ndarray | None = None) -> pb.QuantizedTensor:
    """A valid 8-element, 2-channel wire tensor of ``scheme``, optionally with other zero points."""
    codec = codec_for(scheme)
    config = QuantConfig(scheme=scheme, bits=bits, channel_size=64 if codec.sparse else 4)  # sparse: >= 64
    message = tensor_to_proto(encode(np.linspace(-1.0, 1.0, 8, dtype=np.float32), config))
    assert message.bits == codec.wire_bits(config)
    if zero_points is not None:
        message.zero_point = zero_points.astype("<i4").tobytes()
    return message


def accepted(message: pb.QuantizedTensor) -> bool:
    codec = codec_for(Scheme(message.scheme))
    try:
        codec.from_wire(
            "tensor",
            message.bits,
            message.numel,
            message.channel_size,
            message.scale,
            message.zero_point,
            message.payload,
            message.dtype,
            message.topk,
        )
    except ValueError:
        return False
    return True


def channels(message: pb.QuantizedTensor) -> int:
    return len(message.scale) // 4


@pytest.mark.parametrize("scheme", sorted(registered_schemes()))
def test_each_schemes_zero_points_are_what_its_comment_says(scheme: Scheme) -> None:
    comment = scheme_comment(scheme)
    codec = codec_for(scheme)
    says_none = "no zero points" in comment
    says_one_per_channel = "zero points: one per channel" in comment
    assert says_none != says_one_per_channel, f"SCHEME_{scheme.name}'s comment must say which: {comment!r}"
    bits = 1 if scheme is Scheme.PER_CHANNEL_SIGN else 4
    message = header(scheme, bits)
    count = len(message.zero_point) // 4
    assert count == (channels(message) if says_one_per_channel else 0)  # what the codec sends
    assert (count > 0) == says_one_per_channel
    # Floats have no channels; the sparse scheme's scales are its lookup, and it has no zero points either.
    assert codec.zero_points == says_one_per_channel or codec.num_channels(8, 4) == 0 or codec.sparse
    assert accepted(message)
    # What a receiver accepts: exactly that many, no more and no fewer.
    assert not accepted(header(scheme, bits, np.zeros(count + 1, np.int32)))
    if count:
        assert not accepted(header(scheme, bits, np.zeros(count - 1, np.int32)))


@pytest.mark.parametrize("scheme", sorted(registered_schemes()))
def test_each_schemes_zero_point_values_are_the_ones_its_comment_allows(scheme: Scheme) -> None:
    comment = scheme_comment(scheme)
    bits = 1 if scheme is Scheme.PER_CHANNEL_SIGN else 4
    message = header(scheme, bits)
    count = len(message.zero_point) // 4
    if "no zero points" in comment:  # no value is accepted, not even the grid's zero
        for value in (0, 1):
            assert not accepted(header(scheme, bits, np.full(max(channels(message), 1), value, np.int32)))
        return
    if "each 2^(bits-1)" in comment:
        allowed = {1 << (bits - 1)}
    else:
        assert "in 0..2^bits-1" in comment, comment
        allowed = set(range(1 << bits))
    for value in (-1, 0, 1 << (bits - 1), (1 << bits) - 1, 1 << bits):
        assert accepted(header(scheme, bits, np.full(count, value, np.int32))) == (value in allowed), value


@pytest.mark.parametrize("scheme", sorted(registered_schemes()))
def test_each_schemes_bits_are_the_ones_its_comment_names(scheme: Scheme) -> None:
    comment = scheme_comment(scheme)
    if match := re.search(r"(\d+)\.\.(\d+) bits", comment):
        named = set(range(int(match[1]), int(match[2]) + 1))
    elif match := re.search(r"(\d+)-bit codes", comment):
        named = {int(match[1])}
    elif "1 bit per element" in comment:
        named = {1}
    else:
        match = re.search(r"the values as float(\d+)", comment)
        assert match, comment
        named = {int(match[1])}
    message = header(scheme, 1 if scheme is Scheme.PER_CHANNEL_SIGN else 4)
    symmetric = "each 2^(bits-1)" in comment
    taken = set()
    for bits in range(0, 34):
        probe = pb.QuantizedTensor()
        probe.CopyFrom(message)
        probe.bits = bits
        if not codec_for(scheme).sparse:  # zeros: a level (or a float) at every width
            probe.payload = bytes(-(-message.numel * bits // 8))
        if message.zero_point:  # on the grid at this width, so only the bits decide
            middle = 1 << (bits - 1) if symmetric and 1 <= bits <= 8 else 0
            probe.zero_point = np.full(len(message.zero_point) // 4, middle, "<i4").tobytes()
        if accepted(probe):
            taken.add(bits)
    assert taken == named


def test_the_bucket_keys_layout_in_the_proto_is_the_clients_chunk_key() -> None:
    comment = comment_of("uint64 bucket = 3;")
    low = re.search(r"low (\d+) bits carry the bucket's index", comment)
    high = re.search(r"high (\d+) bits the chunk's", comment)
    formula = re.search(r"key = bucket \+ chunk \* 2\^(\d+)", comment)
    assert low and high and formula, comment
    assert int(low[1]) + int(high[1]) == 64
    assert 1 << int(low[1]) == 1 << int(formula[1]) == CHUNK_KEY_STRIDE
    assert "chunk 0 keeps the bucket's own index" in comment
    for bucket, chunk in ((0, 0), (7, 0), (7, 3), ((1 << 32) - 1, (1 << 32) - 1)):
        key = chunk_key(bucket, chunk)
        assert key < 1 << 64  # fits the uint64 field
        assert (key & ((1 << int(low[1])) - 1), key >> int(low[1])) == (bucket, chunk)
        assert shard_for(key, 3) == (bucket + chunk) % 3


def test_partial_is_set_at_the_deadline_and_when_a_missing_rank_leaves_as_the_proto_says() -> None:
    comment = comment_of("bool partial = 3;")
    assert "--partial-quorum" in comment and "at its deadline" in comment and "left the job" in comment
    clock = [0.0]
    table = RoundTable(RoundPolicy(round_timeout_s=1.0, partial_quorum=2), clock=lambda: clock[0])
    for rank in range(3):
        table.join(JobSpec("job", rank, 3))
    exact = QuantConfig(scheme=Scheme.FLOAT32)
    values = encode(np.ones(4, np.float32), exact)

    def push(step: int, rank: int) -> RoundTicket:
        ticket = table.admit("job", step, 0, rank, values)
        table.add(ticket, values)
        return ticket

    # At the deadline: two of three ranks, the third never comes.
    tickets = [push(0, rank) for rank in (0, 1)]
    clock[0] = 1.0
    at_deadline = table.answer(tickets[0])
    assert at_deadline.partial and at_deadline.missing == (2,)
    # When the missing rank leaves, before the deadline.
    tickets = [push(1, rank) for rank in (0, 1)]
    table.leave("job", 2)
    assert tickets[0].round.done.is_set()  # closed at once, not at its deadline
    on_leave = table.answer(tickets[0])
    assert on_leave.partial and on_leave.missing == (2,)


def test_the_state_chunks_limit_in_the_proto_is_the_one_both_sides_hold_to() -> None:
    comment = comment_of("bytes data = 7;")
    limit = re.search(r"at most (\d+) MiB", comment)
    assert limit, comment
    assert int(limit[1]) << 20 == MAX_STATE_CHUNK_BYTES
    assert STATE_CHUNK_BYTES <= MAX_STATE_CHUNK_BYTES  # what a sender cuts the state into is accepted


def test_job_ranks_zero_means_world_size_as_the_proto_says() -> None:
    comment = comment_of("uint32 job_ranks = 7;")
    assert "0 means world_size" in comment and "--world-size" in comment
    table = RoundTable(RoundPolicy())
    table.join(JobSpec("job", 0, 3))  # job_ranks unset (0): three members of one rank each
    with pytest.raises(FailedPreconditionError, match="job_ranks"):
        table.join(JobSpec("job", 1, 3, job_ranks=6))
