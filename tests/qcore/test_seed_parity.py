"""gradq's 8-bit affine payloads, scales and zero points are identical to seed 000's hooks."""

from __future__ import annotations

import numpy as np
import seed_reference as seed
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradq.qcore import QuantConfig, Scheme, decode, encode

PER_TENSOR = QuantConfig(scheme=Scheme.PER_TENSOR_AFFINE, bits=8)
PER_CHANNEL = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8, channel_size=seed.SEED_CHANNEL_SIZE)

# Sizes: odd ones, ones just past a channel boundary, and exact multiples of 512
# (where the seed pads a whole extra channel).
SIZES = st.one_of(
    st.integers(2, 3000),
    st.integers(1, 6).map(lambda k: k * seed.SEED_CHANNEL_SIZE),
    st.integers(1, 5).map(lambda k: k * seed.SEED_CHANNEL_SIZE + 2),
)
MAGNITUDES = st.floats(-6.0, 3.0).map(lambda e: 10.0**e)
DISTRIBUTIONS = st.sampled_from(["normal", "laplace", "sparse"])


def gradient_like(numel: int, channel_size: int, magnitude: float, seed_value: int, distribution: str) -> np.ndarray:
    """Gradient-shaped float32 values where every channel holds a negative and a positive value.

    That keeps the inputs inside the seed's domain of agreement: gradq widens every
    range to include 0 and gives constant channels scale |v|, the seed does neither.
    """
    rng = np.random.default_rng(seed_value)
    if distribution == "laplace":
        values = rng.laplace(size=numel)
    else:
        values = rng.standard_normal(numel)
        if distribution == "sparse":
            values[rng.random(numel) < 0.3] = 0.0
    x = (values * magnitude).astype(np.float32)
    starts = np.arange(0, numel, channel_size)
    floor = np.float32(magnitude / 8)
    x[starts] = -np.abs(x[starts]) - floor
    x[starts + 1] = np.abs(x[starts + 1]) + floor
    return x


@settings(max_examples=150, deadline=None)
@given(numel=SIZES, magnitude=MAGNITUDES, seed_value=st.integers(0, 2**32 - 1), distribution=DISTRIBUTIONS)
@example(numel=2, magnitude=1.0, seed_value=0, distribution="normal")
@example(numel=3001, magnitude=1e-6, seed_value=1, distribution="laplace")
def test_per_tensor_matches_seed(numel: int, magnitude: float, seed_value: int, distribution: str) -> None:
    x = gradient_like(numel, numel, magnitude, seed_value, distribution)
    expected = seed.quantize_per_tensor(x)

    ours = encode(x, PER_TENSOR)

    np.testing.assert_array_equal(ours.scale, expected.scale)
    np.testing.assert_array_equal(ours.zero_point, expected.zero_point)
    np.testing.assert_array_equal(ours.payload, expected.levels)
    np.testing.assert_array_equal(decode(ours), seed.dequantize_encoding(expected, numel))


@settings(max_examples=150, deadline=None)
@given(
    numel=SIZES.filter(lambda n: n % seed.SEED_CHANNEL_SIZE != 1),
    magnitude=MAGNITUDES,
    seed_value=st.integers(0, 2**32 - 1),
    distribution=DISTRIBUTIONS,
)
@example(numel=512, magnitude=1.0, seed_value=0, distribution="normal")
@example(numel=2048, magnitude=1e3, seed_value=2, distribution="sparse")
@example(numel=2 * 512 + 2, magnitude=1e-6, seed_value=3, distribution="laplace")
def test_per_channel_matches_seed(numel: int, magnitude: float, seed_value: int, distribution: str) -> None:
    channel_size = seed.SEED_CHANNEL_SIZE
    x = gradient_like(numel, channel_size, magnitude, seed_value, distribution)
    expected = seed.quantize_per_channel(x, channel_size)
    num_channels = -(-numel // channel_size)

    ours = encode(x, PER_CHANNEL)

    assert ours.num_channels == num_channels
    np.testing.assert_array_equal(ours.scale, expected.scale[:num_channels])
    np.testing.assert_array_equal(ours.zero_point, expected.zero_point[:num_channels])
    np.testing.assert_array_equal(ours.payload, expected.levels[:numel])
    np.testing.assert_array_equal(decode(ours), seed.dequantize_encoding(expected, channel_size)[:numel])


def test_seed_reference_pads_a_whole_channel_on_exact_multiples() -> None:
    x = gradient_like(1024, 512, 1.0, 0, "normal")

    expected = seed.quantize_per_channel(x)

    assert expected.scale.size == 3
    assert (expected.scale[2], expected.zero_point[2]) == (1.0, 0)


def test_all_positive_channel_is_the_documented_deviation() -> None:
    x = np.linspace(1.0, 2.0, 512, dtype=np.float32)
    expected = seed.quantize_per_channel(x)

    ours = encode(x, PER_CHANNEL)

    # The seed's grid starts at the channel minimum; gradq's starts at 0.
    assert expected.scale[0] == np.float32(1.0 / 255)
    assert ours.scale[0] == np.float32(2.0 / 255)
    assert ours.zero_point[0] == 0
