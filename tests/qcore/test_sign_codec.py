"""The scaled-sign codec: +-mean|x| per channel, both signs in every channel, a contraction, refused off-grid input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.qcore import LOW_BIT_CHANNEL_SIZE, ErrorFeedback, QuantConfig, Scheme, decode, encode, wire_size
from gradq.qcore.codecs import codec_for

SIGN = QuantConfig(scheme=Scheme.PER_CHANNEL_SIGN, channel_size=4)


def test_every_channel_keeps_both_signs_at_its_mean_magnitude() -> None:
    x = np.array([1.0, -1.0, 2.0, -2.0, 0.5, 0.25, -0.25, 0.0, -3.0], np.float32)
    decoded = decode(encode(x, SIGN))
    np.testing.assert_array_equal(decoded, [1.5, -1.5, 1.5, -1.5, 0.25, 0.25, -0.25, 0.25, -3.0])
    # The affine grid at 1 bit holds 0 and one signed step per channel: the negative half is lost.
    affine = decode(encode(x, QuantConfig(bits=1, channel_size=4)))
    assert (affine[[1, 3]] == 0).all()


@settings(max_examples=100, deadline=None)
@given(
    numel=st.integers(1, 2000),
    channel_size=st.integers(1, 700),
    exponent=st.integers(-30, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_scale_is_the_exact_channel_mean_and_error_feedback_contracts(
    numel: int, channel_size: int, exponent: int, seed: int
) -> None:
    x = (np.random.default_rng(seed).standard_normal(numel) * 2.0**exponent).astype(np.float32)
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_SIGN, channel_size=channel_size)
    q = encode(x, config)
    channels = -(-numel // channel_size)
    means = [np.abs(x[c * channel_size : (c + 1) * channel_size]).astype(np.float64).mean() for c in range(channels)]
    np.testing.assert_allclose(q.scale, means, rtol=1e-6)
    assert q.zero_point.size == 0  # a sign has no zero point: 4 bytes of scale per channel, nothing else
    assert q.nbytes == wire_size(numel, config) == 32 + -(-numel // 8) + 4 * channels
    decoded = decode(q)
    np.testing.assert_array_equal(np.sign(decoded), np.where(x >= 0, 1.0, -1.0))
    # What error feedback needs: the residual is smaller than what was sent.
    assert np.sum((x - decoded).astype(np.float64) ** 2) < np.sum(x.astype(np.float64) ** 2)


def test_error_feedback_carries_what_the_signs_dropped() -> None:
    memory = ErrorFeedback()
    rng = np.random.default_rng(0)
    sent_total, true_total = np.zeros(512), np.zeros(512)
    for _ in range(200):
        x = (rng.standard_normal(512) * 1e-3 + 1e-4).astype(np.float32)
        sent_total += decode(memory.encode("bucket", x, QuantConfig(scheme=Scheme.PER_CHANNEL_SIGN)))
        true_total += x
    residual = memory.residual("bucket")
    assert residual is not None
    np.testing.assert_allclose(sent_total + residual, true_total, rtol=1e-4, atol=1e-6)


def test_an_all_zero_channel_decodes_to_the_smallest_magnitude() -> None:
    q = encode(np.zeros(6, np.float32), SIGN)
    assert (q.scale > 0).all()
    assert np.abs(decode(q)).max() <= np.finfo(np.float32).smallest_subnormal


def test_defaults_and_refusals() -> None:
    assert QuantConfig(scheme=Scheme.parse("per_channel_sign")).channel_size == LOW_BIT_CHANNEL_SIZE
    assert encode(np.ones(3, np.float32), QuantConfig(scheme=Scheme.PER_CHANNEL_SIGN, bits=8)).bits == 1
    with pytest.raises(ValueError, match=r"x\[1\]=nan cannot be encoded"):
        encode(np.array([0.0, np.nan], np.float32), SIGN)
    with pytest.raises(ValueError, match="qparams are not used"):
        encode(np.ones(4, np.float32), SIGN, qparams=(np.ones(1), np.zeros(1)))
    codec = codec_for(Scheme.PER_CHANNEL_SIGN)
    scale = np.ones(1, "<f4").tobytes()
    with pytest.raises(ValueError, match=r"tensor.bits=2 is invalid for PER_CHANNEL_SIGN; expected 1"):
        codec.from_wire("tensor", 2, 4, 4, scale, b"", b"\x00", "float32")
    with pytest.raises(ValueError, match=r"tensor.zero_point has 4 bytes; expected 0 \(PER_CHANNEL_SIGN sends no zero"):
        codec.from_wire("tensor", 1, 4, 4, scale, np.zeros(1, "<i4").tobytes(), b"\x00", "float32")
    accepted = codec.from_wire("tensor", 1, 4, 4, scale, b"", b"\x05", "float32")
    np.testing.assert_array_equal(decode(accepted), [1.0, -1.0, 1.0, -1.0])
