"""The sparse top-k codec: what it keeps, its lookup, its size, its torch twin's bytes and what it refuses."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from gradq.proto.convert import tensor_from_proto, tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import ErrorFeedback, QuantConfig, Scheme, decode, decode_accumulate, decode_times, encode, wire_size
from gradq.qcore.codecs import codec_for
from gradq.qcore.codecs.sparse import DEFAULT_CHUNK, DEFAULT_TOPK, SparseCodec, index_bits
from gradq.qcore.torch_codec import TorchErrorFeedback, encode_tensor, to_device

CODEC = codec_for(Scheme.SPARSE_TOPK)
assert isinstance(CODEC, SparseCodec)


def reference_kept(x: np.ndarray, chunk: int, topk: int) -> np.ndarray:
    """Positions a top-k per chunk keeps, by a stable sort: largest |x| first, ties to the lower index, no zeros."""
    kept: list[int] = []
    for start in range(0, x.size, chunk):
        part = np.abs(x[start : start + chunk])
        order = np.argsort(-part, kind="stable")[:topk]
        kept.extend(start + int(index) for index in sorted(order) if part[index] > 0)
    return np.array(kept, np.int64)


def cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    ties = rng.standard_normal(20_000).astype(np.float32)
    ties[:5000] = 0  # chunks with fewer non-zeros than topk
    ties[6000:7000] = 1.5  # more equal magnitudes than places
    rounded = np.round(rng.standard_normal(12_345), 1).astype(np.float32)
    return [rng.standard_normal(n).astype(np.float32) for n in (0, 1, 7, 4096, 4097, 100_000)] + [ties, rounded]


CONFIGS = [
    QuantConfig(Scheme.SPARSE_TOPK),
    QuantConfig(Scheme.SPARSE_TOPK, channel_size=100, topk=7),
    QuantConfig(Scheme.SPARSE_TOPK, channel_size=64, topk=64),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"chunk{c.channel_size}-k{c.topk}")
def test_it_keeps_each_chunks_largest_entries_with_their_signs_and_lookup_means(config: QuantConfig) -> None:
    for x in cases():
        decoded = decode(encode(x, config))
        kept = reference_kept(x, config.channel_size, config.topk)
        assert np.array_equal(np.flatnonzero(decoded), kept)
        assert np.array_equal(np.sign(decoded[kept]), np.sign(x[kept]))
        if kept.size:  # each entry decodes to the mean |x| of its sign's low or high bin
            for sign in (-1, 1):
                mine = kept[np.sign(x[kept]) == sign]
                for level in np.unique(np.abs(decoded[mine])):
                    members = mine[np.abs(decoded[mine]) == level]
                    assert level == pytest.approx(float(np.abs(x[members]).astype(np.float64).mean()), rel=1e-6)


def test_defaults_are_the_anchors_chunk_and_k_at_under_0_22_bits_per_element() -> None:
    config = QuantConfig(Scheme.SPARSE_TOPK)
    assert (config.channel_size, config.topk, index_bits(config.channel_size)) == (DEFAULT_CHUNK, DEFAULT_TOPK, 12)
    x = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)
    encoded = encode(x, config)
    assert encoded.nbytes == wire_size(x.size, config)  # exact when every chunk is full
    assert encoded.nbytes * 8 / x.size <= 0.22
    # bits and channel_size from elsewhere are ignored or refused by name
    assert (
        QuantConfig(Scheme.SPARSE_TOPK, bits=8).bits == 8
        and encode(x[:10], QuantConfig(Scheme.SPARSE_TOPK, bits=8)).bits == 2
    )


def test_the_size_estimate_bounds_a_chunk_that_keeps_fewer() -> None:
    config = QuantConfig(Scheme.SPARSE_TOPK, channel_size=256, topk=16)
    x = np.zeros(1000, np.float32)
    x[[3, 500, 999]] = [1.0, -2.0, 3.0]
    encoded = encode(x, config)
    assert encoded.nbytes <= wire_size(x.size, config)
    assert np.array_equal(np.flatnonzero(decode(encoded)), [3, 500, 999])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"chunk{c.channel_size}-k{c.topk}")
def test_the_torch_twin_writes_the_same_bytes_and_decodes_the_same_values(config: QuantConfig) -> None:
    for x in cases():
        ours, theirs = encode(x, config), encode_tensor(torch.from_numpy(x), config)
        assert ours.payload.tobytes() == theirs.payload.tobytes()
        assert ours.scale.tobytes() == theirs.scale.tobytes() and theirs.topk == config.topk
        out = torch.empty(x.size)
        CODEC.torch().decode(to_device(ours, torch.device("cpu")), ours.numel, out)
        assert np.array_equal(out.numpy(), decode(ours))


def test_error_feedback_with_decay_is_the_same_on_both_libraries_and_loses_nothing_at_1() -> None:
    config = QuantConfig(Scheme.SPARSE_TOPK, channel_size=512, topk=8)
    rng = np.random.default_rng(3)
    steps = [rng.standard_normal(3000).astype(np.float32) for _ in range(4)]
    for decay in (1.0, 0.95):
        numpy_feedback, torch_feedback = ErrorFeedback(decay), TorchErrorFeedback(decay)
        sent = np.zeros(3000, np.float64)
        for x in steps:
            a = numpy_feedback.encode(0, x, config)
            b = torch_feedback.encode(0, torch.from_numpy(x), config)
            assert a.payload.tobytes() == b.payload.tobytes() and a.scale.tobytes() == b.scale.tobytes()
            sent += decode(a)
        residual = numpy_feedback.residual(0)
        assert residual is not None
        on_torch = torch_feedback.residual(0)
        assert on_torch is not None and np.array_equal(residual, on_torch.numpy())
        if decay == 1.0:  # what was sent plus what waits is everything pushed
            assert np.allclose(sent + residual, np.sum(steps, axis=0, dtype=np.float64), atol=1e-4)
    with pytest.raises(ValueError, match=r"error_feedback_decay=1.5 is invalid; expected a number in \(0, 1\]"):
        ErrorFeedback(1.5)


def test_accumulating_touches_only_the_kept_entries_and_divides_like_the_dense_path() -> None:
    config = QuantConfig(Scheme.SPARSE_TOPK, channel_size=128, topk=4)
    rng = np.random.default_rng(5)
    pushes = [encode(rng.standard_normal(1000).astype(np.float32), config) for _ in range(3)]
    total = np.zeros(1000, np.float32)
    for index, push in enumerate(pushes):
        decode_accumulate(push, total, divide_by=3 if index == 2 else 1)
    expected = np.zeros(1000, np.float32)
    for push in pushes:
        expected += decode(push)
    assert np.array_equal(total, expected / np.float32(3))
    weighted = np.zeros(1000, np.float32)
    decode_times(pushes[0], weighted, 2.5, accumulate=True)
    assert np.allclose(weighted, decode(pushes[0]) * 2.5, rtol=1e-6)


def test_a_push_survives_the_wire() -> None:
    x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32)
    encoded = encode(x, QuantConfig(Scheme.SPARSE_TOPK))
    received = tensor_from_proto(pb.QuantizedTensor.FromString(tensor_to_proto(encoded).SerializeToString()))
    assert received.topk == DEFAULT_TOPK and np.array_equal(decode(received), decode(encoded))


def wire(x: np.ndarray, config: QuantConfig) -> pb.QuantizedTensor:
    return tensor_to_proto(encode(x, config))


def crafted(numel: int, chunk: int, topk: int, counts: list[int], indices: list[int]) -> pb.QuantizedTensor:
    """A message whose payload holds the given counts and indices (codes 3: positive, high)."""
    message = wire(np.ones(numel, np.float32), QuantConfig(Scheme.SPARSE_TOPK, channel_size=chunk, topk=topk))
    codes = np.full(len(indices), 3, np.uint8)
    payload = SparseCodec.payload_of(numel, chunk, topk, np.array(counts), np.array(indices), codes)
    message.payload = payload.tobytes()
    return message


def refused(message: pb.QuantizedTensor) -> str:
    with pytest.raises(ValueError) as caught:
        tensor_from_proto(message, "tensor")
    return str(caught.value)


def test_bad_pushes_are_refused_by_name() -> None:
    assert tensor_from_proto(crafted(128, 64, 2, [2, 1], [3, 7, 0]))  # a well-formed one passes
    assert "entry 1's index 3 in chunk 0 does not follow" in refused(crafted(128, 64, 2, [2, 2], [3, 3, 0, 1]))
    assert "entry 1's index 2 in chunk 0 does not follow" in refused(crafted(128, 64, 2, [2, 2], [3, 2, 0, 1]))
    assert "entry 2's index 40 is outside chunk 1 of 36 elements" in refused(crafted(100, 64, 2, [2, 2], [3, 5, 40, 1]))
    assert "index 9 is outside chunk 1 of 5 elements" in refused(crafted(69, 64, 2, [2, 2], [0, 1, 2, 9]))
    short = crafted(128, 64, 2, [2, 2], [3, 5, 0, 1])
    short.payload = short.payload[:-1]
    assert "payload has" in refused(short) and "expected" in refused(short)
    long = crafted(128, 64, 2, [2, 2], [3, 5, 0, 1])
    long.payload += b"\0"
    assert "payload has" in refused(long)
    # a chunk flagged partial whose count is not below its full count
    message = crafted(128, 64, 2, [1, 2], [3, 0, 1])
    payload = bytearray(message.payload)
    payload[1:3] = (5).to_bytes(2, "little")
    message.payload = bytes(payload)
    assert "chunk 0's count is 5; expected below 2" in refused(message)
    for bad in (float("nan"), float("inf"), 0.0):
        message = wire(np.ones(128, np.float32), QuantConfig(Scheme.SPARSE_TOPK, channel_size=64, topk=2))
        lookup = np.frombuffer(message.scale, "<f4").copy()
        lookup[1] = bad
        message.scale = lookup.tobytes()
        assert f"tensor.scale[1]={bad}" in refused(message)
    message = wire(np.ones(128, np.float32), QuantConfig(Scheme.SPARSE_TOPK, channel_size=64, topk=2))
    for field, value, says in (
        ("topk", 65, "tensor.topk=65 is invalid for SPARSE_TOPK; expected 1..64"),
        ("topk", 0, "tensor.topk=0 is invalid"),
        ("bits", 4, "tensor.bits=4 is invalid for SPARSE_TOPK; expected 2"),
        ("channel_size", 32, "tensor.channel_size=32 is invalid; expected 64..65536"),
        ("channel_size", 1 << 17, "tensor.channel_size=131072 is invalid; expected 64..65536"),
        ("zero_point", b"\0\0\0\0", "tensor.zero_point has 4 bytes; expected 0"),
        ("scale", b"\0" * 12, "tensor.scale has 12 bytes; expected 16"),
    ):
        probe = pb.QuantizedTensor()
        probe.CopyFrom(message)
        setattr(probe, field, value)
        assert says in refused(probe), field
    # another scheme with a topk is refused too
    dense = wire(np.ones(8, np.float32), QuantConfig(Scheme.PER_CHANNEL_AFFINE, bits=4, channel_size=4))
    dense.topk = 3
    assert "tensor.topk=3 is invalid for PER_CHANNEL_AFFINE; expected 0" in refused(dense)


def test_configs_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"topk=65 is invalid for scheme=sparse_topk; expected 1\.\.channel_size=64"):
        QuantConfig(Scheme.SPARSE_TOPK, channel_size=64, topk=65)
    with pytest.raises(ValueError, match=r"channel_size=70000 is invalid for scheme=sparse_topk; expected a chunk"):
        QuantConfig(Scheme.SPARSE_TOPK, channel_size=70_000)
    with pytest.raises(ValueError, match="topk=4 is only for scheme=sparse_topk; expected 0 for scheme=per_channel_"):
        QuantConfig(Scheme.PER_CHANNEL_AFFINE, topk=4)
    with pytest.raises(ValueError, match="topk=-1 is invalid"):
        QuantConfig(Scheme.SPARSE_TOPK, topk=-1)
    assert QuantConfig(Scheme.SPARSE_TOPK, channel_size=64).topk == 64  # the smallest chunk keeps all of itself
    with pytest.raises(ValueError, match=r"x\[5\]=nan cannot be encoded"):
        encode(np.array([0, 1, 2, 3, 4, np.nan], np.float32), QuantConfig(Scheme.SPARSE_TOPK))


@pytest.mark.parametrize(("chunk", "topk"), [(4096, 4096), (64, 64)], ids=["every-entry-kept", "smallest-chunks"])
def test_reading_and_summing_a_push_allocates_less_than_its_dense_sum(chunk: int, topk: int) -> None:
    # A push may claim as many entries as its chunks hold, or the smallest chunks: still it costs the
    # aggregator less memory to check and add than the float32 sum it is added to.
    numel = 1 << 22
    message = wire(
        np.random.default_rng(4).standard_normal(numel).astype(np.float32),
        QuantConfig(Scheme.SPARSE_TOPK, channel_size=chunk, topk=topk),
    )
    total = np.zeros(numel, np.float32)
    tracemalloc.start()
    try:
        decode_accumulate(tensor_from_proto(message), total)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * numel, peak
    assert np.count_nonzero(total) == numel  # every entry was kept and added
