"""Stochastic rounding: unbiased on average, under one step per element, reproducible from its seed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.qcore import QuantConfig, QuantizedArray, Rounding, Scheme, decode, encode
from gradq.qcore.codecs import codec_for
from gradq.qcore.codecs.uniform import UniformCodec

DRAWS = 2000
CHANNEL_SIZE = 64


def mean_of_decodes(x: np.ndarray, config: QuantConfig, draws: int = DRAWS) -> np.ndarray:
    """Average of ``draws`` independent stochastic round trips of ``x`` (float64)."""
    rng = np.random.default_rng(1234)
    total = np.zeros(x.size, np.float64)
    for _ in range(draws):
        total += decode(encode(x, config, rng=rng))
    return total / draws


def element_scales(q: QuantizedArray) -> np.ndarray:
    """The scale of each element's channel, as float64."""
    return np.repeat(q.scale.astype(np.float64), q.channel_size)[: q.numel]


def mean_error_bound(scale: np.ndarray, draws: int = DRAWS) -> np.ndarray:
    """Five standard deviations of the mean of ``draws`` stochastic roundings.

    An element at ``k + p`` steps decodes to ``k + 1`` with probability p, else k:
    the error has mean 0, lies in (-scale, scale) and has variance
    ``p (1 - p) scale**2 <= scale**2 / 4``, so the mean of ``draws`` independent
    roundings has standard deviation at most ``scale / (2 sqrt(draws))``. The
    generator is seeded, so the test is deterministic; float32 rounding adds a
    bias near 1e-5 of a step, far below the bound.
    """
    return 5 * scale / (2 * np.sqrt(draws))


def scheme_id(value: object) -> str | None:
    """Readable test ids for schemes; pytest's default for everything else."""
    return value.name.lower() if isinstance(value, Scheme) else None


def stochastic(scheme: Scheme, bits: int, channel_size: int = CHANNEL_SIZE, seed: int | None = None) -> QuantConfig:
    """A stochastic-rounding config."""
    return QuantConfig(scheme=scheme, bits=bits, channel_size=channel_size, rounding=Rounding.STOCHASTIC, seed=seed)


@pytest.mark.parametrize(
    ("scheme", "bits"),
    [
        (Scheme.PER_CHANNEL_AFFINE, 1),
        (Scheme.PER_CHANNEL_AFFINE, 2),
        (Scheme.PER_CHANNEL_AFFINE, 8),
        (Scheme.PER_CHANNEL_SYMMETRIC, 2),
        (Scheme.PER_CHANNEL_SYMMETRIC, 4),
        (Scheme.PER_TENSOR_AFFINE, 4),
    ],
    ids=scheme_id,
)
def test_unbiased_for_values_inside_the_grid(scheme: Scheme, bits: int) -> None:
    config = stochastic(scheme, bits)
    x = np.random.default_rng(bits).standard_normal(4 * CHANNEL_SIZE).astype(np.float32)
    q = encode(x, config)
    scale = element_scales(q)
    zero_point = np.repeat(q.zero_point, q.channel_size)[: q.numel]
    inside = (x >= -zero_point * scale) & (x <= (config.qmax - zero_point) * scale)

    error = np.abs(mean_of_decodes(x, config) - x)

    assert inside.mean() > 0.4
    assert (error[inside] <= mean_error_bound(scale[inside])).all()


@pytest.mark.parametrize(
    ("scheme", "values"),
    [
        # scale = 1/1.5, top level = +1 step = 0.667: x = 1.0 can never decode to more.
        (Scheme.PER_TENSOR_SYMMETRIC, [1.0, -0.2, 0.3]),
        # scale = 1, zero point = rint(0.5) = 0: the grid is [0, 3], x = -0.5 always decodes to 0.
        (Scheme.PER_TENSOR_AFFINE, [-0.5, 2.5, 1.2]),
    ],
    ids=scheme_id,
)
def test_unbiased_at_the_channel_extremes(scheme: Scheme, values: list[float]) -> None:
    config = stochastic(scheme, bits=2)
    x = np.array(values, np.float32)
    scale = element_scales(encode(x, config))

    mean = mean_of_decodes(x, config)

    assert (np.abs(mean - x) <= mean_error_bound(scale)).all(), f"mean of decodes {mean} for x={x}"


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from([s for s in Scheme if isinstance(codec_for(s), UniformCodec)]),  # rounding's grids
    bits=st.integers(2, 8),
    channel_size=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.integers(-20, 20).map(lambda e: 10.0**e),
)
def test_error_is_under_one_step(scheme: Scheme, bits: int, channel_size: int, seed: int, magnitude: float) -> None:
    config = stochastic(scheme, bits, channel_size, seed)
    x = (np.random.default_rng(seed).standard_normal(1000) * magnitude).astype(np.float32)

    q = encode(x, config)
    error = np.abs(x.astype(np.float64) - decode(q))

    # One step, widened only by float32 roundoff (a few 2**-24 of |x|).
    assert (error < element_scales(q) * (1 + 1e-5) + 4 * 2.0**-24 * np.abs(x)).all()


def test_same_seed_gives_the_same_payload() -> None:
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)

    from_config = [encode(x, stochastic(Scheme.PER_CHANNEL_AFFINE, 4, seed=7)).payload for _ in range(2)]
    from_rng = [
        encode(x, stochastic(Scheme.PER_CHANNEL_AFFINE, 4), rng=np.random.default_rng(7)).payload for _ in range(2)
    ]

    np.testing.assert_array_equal(from_config[0], from_config[1])
    np.testing.assert_array_equal(from_rng[0], from_rng[1])


def test_different_draws_give_different_payloads() -> None:
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    config = stochastic(Scheme.PER_CHANNEL_AFFINE, 4)
    rng = np.random.default_rng(7)

    successive = [encode(x, config, rng=rng).payload for _ in range(2)]
    seeded = [encode(x, stochastic(Scheme.PER_CHANNEL_AFFINE, 4, seed=seed)).payload for seed in (1, 2)]
    fresh = [encode(x, config).payload for _ in range(2)]

    for first, second in (successive, seeded, fresh):
        assert not np.array_equal(first, second)
