"""Round trips through every quantization grid: error bounds, exact values, sizes and rejected inputs."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from gradq.qcore import (
    QuantConfig,
    QuantizedArray,
    Rounding,
    Scheme,
    decode,
    decode_accumulate,
    encode,
    fake_quantize,
    wire_size,
)
from gradq.qcore.codecs import codec_for
from gradq.qcore.codecs.sparse import SMALLEST_CHUNK
from gradq.qcore.codecs.uniform import UniformCodec

# The integer grids: the scaled sign (tests/qcore/test_sign_codec.py) has levels of its own.
QUANTIZED_SCHEMES = [scheme for scheme in Scheme if isinstance(codec_for(scheme), UniformCodec)]


def uniform(scheme: Scheme) -> UniformCodec:
    """The integer-grid codec of ``scheme``."""
    codec = codec_for(scheme)
    assert isinstance(codec, UniformCodec)
    return codec


# One float32 rounding: relative error at most 2**-24.
UNIT_ROUNDOFF = 2.0**-24
SETTINGS = settings(max_examples=200, deadline=None)


def scheme_id(scheme: Scheme) -> str:
    """A readable test id: the scheme's lower-case name."""
    return scheme.name.lower()


@st.composite
def quantized_configs(draw: st.DrawFn) -> QuantConfig:
    """Any integer grid: scheme, bits (symmetric needs 2+), channel size."""
    scheme = draw(st.sampled_from(QUANTIZED_SCHEMES))
    bits = draw(st.integers(uniform(scheme).lowest_bits, 8))
    channel_size = draw(st.integers(1, 300) | st.just(512))
    return QuantConfig(scheme=scheme, bits=bits, channel_size=channel_size)


@st.composite
def gradients(draw: st.DrawFn) -> np.ndarray:
    """float32 arrays of any shape, magnitudes 1e-30..1e30, with an offset and some exact zeros."""
    shape = draw(array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=24))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = 10.0 ** draw(st.integers(-30, 30))
    offset = draw(st.floats(-3.0, 3.0))
    numel = math.prod(shape)
    values = (rng.standard_normal(numel) + offset) * magnitude
    values[rng.random(numel) < draw(st.sampled_from([0.0, 0.2]))] = 0.0
    return values.astype(np.float32).reshape(shape)


def element_scales(q: QuantizedArray) -> np.ndarray:
    """The scale of each element's channel, as float64."""
    return np.repeat(q.scale.astype(np.float64), q.channel_size)[: q.numel]


def rounding_slack(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Half a step plus float32 rounding.

    ``x / scale`` and ``scale * level`` each round once in float32 and the scale is
    itself a float32, so the exact half-step bound moves by a few units of
    roundoff of |x| (up to ~1e-5 of a step at 255 steps from zero).
    """
    return 0.5 * scale * (1 + 1e-5) + 4 * UNIT_ROUNDOFF * np.abs(x)


@SETTINGS
@given(x=gradients(), config=quantized_configs())
def test_nearest_round_trip_is_within_half_a_step(x: np.ndarray, config: QuantConfig) -> None:
    flat = x.reshape(-1).astype(np.float64)

    q = encode(x, config)
    decoded = decode(q).astype(np.float64)

    # The grid is fitted to each channel's min/max, so even the extremes land within
    # half a step (only the zero point's rounding shifts the grid's ends).
    error = np.abs(flat - decoded)
    assert (error <= rounding_slack(flat, element_scales(q))).all()


@SETTINGS
@given(x=gradients(), config=quantized_configs())
def test_zeros_decode_to_exactly_zero(x: np.ndarray, config: QuantConfig) -> None:
    flat = x.reshape(-1)
    flat[::3] = 0.0

    decoded = decode(encode(flat, config))

    np.testing.assert_array_equal(decoded[flat == 0.0], 0.0)


@SETTINGS
@given(
    values=st.lists(
        # Quantized schemes take |x| < 2**126 (larger is refused, tested below).
        st.floats(-(2.0**125), 2.0**125, width=32, allow_subnormal=False).filter(lambda v: v != 0),
        min_size=1,
        max_size=5,
    ),
    config=quantized_configs(),
)
def test_constant_channels_round_trip_exactly(values: list[float], config: QuantConfig) -> None:
    channel_size = config.channel_size if uniform(config.scheme).per_channel else 7
    x = np.repeat(np.array(values, np.float32), channel_size)
    if not uniform(config.scheme).per_channel:
        x[:] = x[0]

    np.testing.assert_array_equal(fake_quantize(x, config), x)


@pytest.mark.parametrize("scheme", [Scheme.PER_CHANNEL_AFFINE, Scheme.PER_CHANNEL_SYMMETRIC], ids=scheme_id)
def test_subnormal_constant_round_trips_exactly(scheme: Scheme) -> None:
    x = np.full(4, -1e-40, np.float32)

    np.testing.assert_array_equal(fake_quantize(x, QuantConfig(scheme=scheme, bits=4)), x)


@pytest.mark.parametrize("scheme", [Scheme.PER_CHANNEL_AFFINE, Scheme.PER_CHANNEL_SYMMETRIC], ids=scheme_id)
def test_values_too_large_to_quantize_are_refused_by_index(scheme: Scheme) -> None:
    # |x| >= 2**126 would put the grid's ends past float32's maximum on decode.
    x = np.array([0.0, 1.0, 2.0**126, -1.0], np.float32)

    with pytest.raises(
        ValueError, match=r"x\[2\]=8\.5\d*e\+37 cannot be encoded; expected finite values with \|x\| < 2\*\*126"
    ):
        encode(x, QuantConfig(scheme=scheme, bits=8))


@pytest.mark.parametrize("scheme", QUANTIZED_SCHEMES, ids=scheme_id)
def test_largest_quantizable_values_decode_finite_within_half_a_step(scheme: Scheme) -> None:
    big = np.nextafter(np.float32(2.0**126), np.float32(0))
    x = np.array([-big, big, 0.0], np.float32)

    q = encode(x, QuantConfig(scheme=scheme, bits=8))
    decoded = decode(q)

    assert np.isfinite(decoded).all(), f"finite input decoded to {decoded}"
    flat = x.astype(np.float64)
    assert (np.abs(flat - decoded) <= rounding_slack(flat, element_scales(q))).all()


def test_float16_scheme_refuses_values_it_would_turn_into_inf() -> None:
    with pytest.raises(ValueError, match=r"x\[1\]=70000\.0 cannot be encoded; expected \|x\| <= 65504"):
        encode(np.array([1.0, 70000.0], np.float32), QuantConfig(Scheme.FLOAT16))


@pytest.mark.parametrize("scheme", list(Scheme), ids=scheme_id)
@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_empty_input_round_trips(scheme: Scheme, shape: tuple[int, ...]) -> None:
    config = QuantConfig(scheme=scheme)

    q = encode(np.empty(shape, np.float32), config)

    assert q.numel == 0
    assert q.payload.size == 0
    assert decode(q).shape == (0,)
    assert fake_quantize(np.empty(shape, np.float32), config).shape == shape
    assert wire_size(0, config) == q.nbytes


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 2000),
    data=st.data(),
    bad=st.sampled_from([math.nan, math.inf, -math.inf]),
    scheme=st.sampled_from(list(Scheme)),
    channel_size=st.integers(1, 600),
)
def test_non_finite_input_is_rejected_naming_the_index(
    numel: int, data: st.DataObject, bad: float, scheme: Scheme, channel_size: int
) -> None:
    index = data.draw(st.integers(0, numel - 1), label="index")
    x = np.linspace(-1.0, 1.0, numel, dtype=np.float32)
    x[index] = bad

    channel_size = max(channel_size, SMALLEST_CHUNK) if codec_for(scheme).sparse else channel_size
    with pytest.raises(ValueError, match=re.escape(f"x[{index}]=")):
        encode(x, QuantConfig(scheme=scheme, bits=4, channel_size=channel_size))


@SETTINGS
@given(x=gradients(), config=quantized_configs(), rounding=st.sampled_from(list(Rounding)))
def test_fake_quantize_is_decode_of_encode_in_the_input_shape(
    x: np.ndarray, config: QuantConfig, rounding: Rounding
) -> None:
    config = QuantConfig(scheme=config.scheme, bits=config.bits, channel_size=config.channel_size, rounding=rounding)

    faked = fake_quantize(x, config, rng=np.random.default_rng(11))
    expected = decode(encode(x, config, rng=np.random.default_rng(11)))

    assert faked.shape == x.shape
    assert faked.dtype == np.float32
    np.testing.assert_array_equal(faked.reshape(-1), expected)


@SETTINGS
@given(x=gradients(), config=quantized_configs(), seed_value=st.integers(0, 2**32 - 1))
def test_decode_accumulate_adds_exactly_the_decoded_values(x: np.ndarray, config: QuantConfig, seed_value: int) -> None:
    q = encode(x, config)
    accumulator = np.random.default_rng(seed_value).standard_normal(q.numel).astype(np.float32)
    expected = accumulator + decode(q)

    decode_accumulate(q, accumulator)

    np.testing.assert_array_equal(accumulator, expected)


@SETTINGS
@given(
    x=gradients(),
    config=quantized_configs() | st.just(QuantConfig(Scheme.FLOAT32)),
    ranks=st.integers(2, 17),
    seed_value=st.integers(0, 2**32 - 1),
)
def test_decode_accumulate_then_divide_matches_adding_and_dividing_apart(
    x: np.ndarray, config: QuantConfig, ranks: int, seed_value: int
) -> None:
    q = encode(x, config)
    accumulator = np.random.default_rng(seed_value).standard_normal(q.numel).astype(np.float32)
    expected = (accumulator + decode(q)) / np.float32(ranks)

    decode_accumulate(q, accumulator, divide_by=ranks)

    np.testing.assert_array_equal(accumulator, expected)


def test_decode_accumulate_rejects_a_float64_accumulator() -> None:
    q = encode(np.ones(5, np.float32), QuantConfig())

    with pytest.raises(ValueError, match="dtype=float64"):
        decode_accumulate(q, np.zeros(5, np.float64))


@SETTINGS
@given(
    x=gradients(),
    config=quantized_configs() | st.sampled_from([QuantConfig(Scheme.FLOAT32), QuantConfig(Scheme.FLOAT16)]),
)
def test_payload_and_wire_sizes(x: np.ndarray, config: QuantConfig) -> None:
    if config.scheme is Scheme.FLOAT16:
        x = np.clip(x, -60000, 60000)  # beyond float16's range is refused (tested above)
    q = encode(x, config)

    assert q.payload.dtype == np.uint8
    assert q.payload.size == math.ceil(x.size * q.bits / 8)
    assert wire_size(x.size, config) == q.nbytes


@SETTINGS
@given(x=gradients())
def test_float32_scheme_round_trips_bit_exactly(x: np.ndarray) -> None:
    decoded = decode(encode(x, QuantConfig(Scheme.FLOAT32)))

    np.testing.assert_array_equal(decoded.view(np.uint32), x.reshape(-1).view(np.uint32))


@SETTINGS
@given(x=gradients().map(lambda a: np.clip(a, -60000.0, 60000.0)))
def test_float16_scheme_round_trips_to_the_nearest_half(x: np.ndarray) -> None:
    decoded = decode(encode(x, QuantConfig(Scheme.FLOAT16)))

    np.testing.assert_array_equal(decoded, x.reshape(-1).astype(np.float16).astype(np.float32))
