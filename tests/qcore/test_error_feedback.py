"""ErrorFeedback delays quantization error instead of losing it, per key."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.qcore import ErrorFeedback, QuantConfig, Rounding, Scheme, decode, encode
from gradq.qcore.codecs import Codec, codec_for
from gradq.qcore.codecs.sparse import SMALLEST_CHUNK

# One float32 rounding: relative error at most 2**-24.
UNIT_ROUNDOFF = 2.0**-24


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 30),
    numel=st.integers(1, 700),
    bits=st.integers(2, 8),
    scheme=st.sampled_from([s for s in Scheme if s.is_quantized]),
    rounding=st.sampled_from(list(Rounding)),
)
def test_sum_of_sends_is_sum_of_inputs_minus_final_residual(
    seed: int, steps: int, numel: int, bits: int, scheme: Scheme, rounding: Rounding
) -> None:
    rng = np.random.default_rng(seed)
    config = QuantConfig(scheme=scheme, bits=bits, channel_size=64, rounding=rounding)
    feedback = ErrorFeedback()
    inputs = (rng.standard_normal((steps, numel)) * 10.0 ** rng.uniform(-4, 4, (steps, 1))).astype(np.float32)

    sent = sum(decode(feedback.encode("bucket", x, config, rng=rng)).astype(np.float64) for x in inputs)

    residual = feedback.residual("bucket")
    assert residual is not None
    expected = inputs.astype(np.float64).sum(axis=0) - residual
    # Each step rounds x + e and (x + e) - decoded once in float32.
    tolerance = 4 * steps * UNIT_ROUNDOFF * (np.abs(inputs).max() + np.abs(sent).max() / steps + np.abs(residual).max())
    np.testing.assert_allclose(sent, expected, rtol=0, atol=tolerance)


def test_residual_is_applied_to_the_next_send_of_the_same_key() -> None:
    rng = np.random.default_rng(0)
    config = QuantConfig(Scheme.PER_CHANNEL_AFFINE, bits=2, channel_size=8)
    first, second = rng.standard_normal((2, 20)).astype(np.float32)
    feedback = ErrorFeedback()

    feedback.encode("a", first, config)
    residual = feedback.residual("a")
    assert residual is not None
    carried = first - decode(encode(first, config))
    np.testing.assert_array_equal(residual, carried)
    sent = feedback.encode("a", second, config)

    np.testing.assert_array_equal(sent.payload, encode(second + carried, config).payload)
    assert not np.array_equal(sent.payload, encode(second, config).payload)


def test_key_whose_size_changes_starts_fresh() -> None:
    rng = np.random.default_rng(1)
    config = QuantConfig(Scheme.PER_CHANNEL_AFFINE, bits=2, channel_size=8)
    feedback = ErrorFeedback()
    feedback.encode("bucket", rng.standard_normal(20).astype(np.float32), config)
    feedback.encode("other", rng.standard_normal(20).astype(np.float32), config)
    other_before = feedback.residual("other")
    assert other_before is not None
    other_before = other_before.copy()
    resized = rng.standard_normal(24).astype(np.float32)

    sent = feedback.encode("bucket", resized, config)

    plain = encode(resized, config)
    np.testing.assert_array_equal(sent.payload, plain.payload)
    np.testing.assert_array_equal(sent.scale, plain.scale)
    np.testing.assert_array_equal(feedback.residual("bucket"), resized - decode(plain))
    np.testing.assert_array_equal(feedback.residual("other"), other_before)
    assert len(feedback) == 2


@pytest.mark.parametrize(
    "scheme", [Scheme.PER_CHANNEL_AFFINE, Scheme.PER_TENSOR_SYMMETRIC], ids=lambda s: s.name.lower()
)
def test_two_bit_error_feedback_tracks_a_constant_gradient(scheme: Scheme) -> None:
    config = QuantConfig(scheme, bits=2, channel_size=64)
    gradient = np.random.default_rng(2).standard_normal(512).astype(np.float32)
    steps = 50
    feedback = ErrorFeedback()

    with_feedback = sum(decode(feedback.encode("g", gradient, config)).astype(np.float64) for _ in range(steps))
    without_feedback = steps * decode(encode(gradient, config)).astype(np.float64)

    target = steps * gradient.astype(np.float64)
    error_with = np.linalg.norm(with_feedback - target)
    error_without = np.linalg.norm(without_feedback - target)
    # Without feedback the rounding error repeats every step (grows like steps);
    # with it the error stays one residual (about one step of the grid).
    assert error_with < error_without / 10
    step = float(np.max(encode(gradient, config).scale))
    assert np.abs(with_feedback - target).max() <= 2 * step


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    numel=st.integers(0, 900),
    channel_size=st.integers(1, 300),
    bits=st.integers(1, 8),
    scheme=st.sampled_from([s for s in Scheme if s.is_quantized]),
    rounding=st.sampled_from(list(Rounding)),
)
def test_fused_step_is_byte_for_byte_the_composition_of_encode_and_decode(
    seed: int, numel: int, channel_size: int, bits: int, scheme: Scheme, rounding: Rounding
) -> None:
    bits = max(bits, 2) if scheme in (Scheme.PER_TENSOR_SYMMETRIC, Scheme.PER_CHANNEL_SYMMETRIC) else bits
    channel_size = max(channel_size, SMALLEST_CHUNK) if codec_for(scheme).sparse else channel_size
    config = QuantConfig(scheme=scheme, bits=bits, channel_size=channel_size, rounding=rounding, seed=seed)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(numel) * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
    carried = (rng.standard_normal(numel) * 1e-3).astype(np.float32)
    codec = codec_for(scheme)
    fused_residual, composed_residual = carried.copy(), carried.copy()
    fused = codec.encode_compensated(x, fused_residual, config, np.random.default_rng(seed), "float32")
    composed = Codec.encode_compensated(codec, x, composed_residual, config, np.random.default_rng(seed), "float32")
    for field in ("scale", "zero_point", "payload"):
        np.testing.assert_array_equal(getattr(fused, field), getattr(composed, field), err_msg=field)
    np.testing.assert_array_equal(fused_residual, composed_residual)


@pytest.mark.parametrize("scheme", [Scheme.PER_CHANNEL_AFFINE, Scheme.PER_CHANNEL_SIGN])
def test_a_bucket_refused_for_nan_leaves_no_residual(scheme: Scheme) -> None:
    feedback, config = ErrorFeedback(), QuantConfig(scheme=scheme, bits=2, channel_size=4)
    feedback.encode("bucket", np.linspace(-1, 1, 8, dtype=np.float32), config)
    assert feedback.residual("bucket") is not None
    with pytest.raises(ValueError, match=r"x\[5\]=nan cannot be encoded"):
        feedback.encode("bucket", np.array([0, 1, 2, 3, 4, np.nan, 6, 7], np.float32), config)
    assert feedback.residual("bucket") is None
