"""QuantConfig validation and the observers' statistics-to-qparams contract."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.qcore import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PercentileObserver,
    PerChannelMinMaxObserver,
    QuantConfig,
    Rounding,
    Scheme,
    calculate_qparams,
    decode,
    encode,
    observer_for,
)


def class_name(cls: type) -> str:
    """A readable test id: the class's name."""
    return cls.__name__


REJECTED_FIELDS = [
    ({"bits": 0}, "bits=0"),
    ({"bits": 9}, "bits=9"),
    ({"bits": True}, "bits=True"),
    ({"bits": 2.5}, "bits=2.5"),
    ({"channel_size": -1}, "channel_size=-1"),
    ({"channel_size": True}, "channel_size=True"),
    ({"scheme": "per_row"}, "scheme='per_row'"),
    ({"scheme": 99}, "scheme=99"),
    ({"scheme": True}, "scheme=True"),
    ({"rounding": "up"}, "rounding='up'"),
    ({"rounding": True}, "rounding=True"),
    ({"scheme": "per_tensor_symmetric", "bits": 1}, "bits=1"),
    ({"scheme": "per_channel_symmetric", "bits": 1}, "scheme=per_channel_symmetric"),
    ({"seed": -1}, "seed=-1"),
    ({"seed": 1.5}, "seed=1.5"),
]


@pytest.mark.parametrize(("fields", "expected"), REJECTED_FIELDS, ids=[expected for _, expected in REJECTED_FIELDS])
def test_config_rejects_bad_fields_naming_field_and_value(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)) as raised:
        QuantConfig(**fields)

    assert "expected" in str(raised.value) or "needs" in str(raised.value)


@pytest.mark.parametrize(
    ("name", "scheme"),
    [
        ("per_channel_affine", Scheme.PER_CHANNEL_AFFINE),
        ("PER-TENSOR-SYMMETRIC", Scheme.PER_TENSOR_SYMMETRIC),
        (" float16 ", Scheme.FLOAT16),
        (5, Scheme.PER_CHANNEL_AFFINE),
        (Scheme.FLOAT32, Scheme.FLOAT32),
    ],
)
def test_scheme_names_parse(name: str | int | Scheme, scheme: Scheme) -> None:
    fields: dict[str, Any] = {"scheme": name}

    assert Scheme.parse(name) is scheme
    assert QuantConfig(**fields).scheme is scheme


@pytest.mark.parametrize(
    ("name", "rounding"),
    [("stochastic", Rounding.STOCHASTIC), (" Nearest ", Rounding.NEAREST), (2, Rounding.STOCHASTIC)],
)
def test_rounding_names_parse(name: str | int, rounding: Rounding) -> None:
    fields: dict[str, Any] = {"rounding": name}

    assert Rounding.parse(name) is rounding
    assert QuantConfig(**fields).rounding is rounding


@pytest.mark.parametrize(
    "observer_type",
    [
        MinMaxObserver,
        MovingAverageMinMaxObserver,
        PerChannelMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        PercentileObserver,
    ],
    ids=class_name,
)
def test_calculate_qparams_before_observe_raises(observer_type: type[MinMaxObserver]) -> None:
    with pytest.raises(RuntimeError, match=re.escape(f"{observer_type.__name__}.calculate_qparams()")):
        observer_type().calculate_qparams()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.integers(2, 8), symmetric=st.booleans())
def test_min_max_observer_over_batches_uses_the_overall_range(seed: int, bits: int, symmetric: bool) -> None:
    rng = np.random.default_rng(seed)
    first = (rng.standard_normal(300) * rng.uniform(0.1, 10)).astype(np.float32)
    second = (rng.standard_normal(200) * rng.uniform(0.1, 10) + rng.uniform(-5, 5)).astype(np.float32)
    observer = MinMaxObserver(bits=bits, symmetric=symmetric)

    observer.observe(first)
    observer.observe(second)
    scale, zero_point = observer.calculate_qparams()

    both = np.concatenate([first, second])
    expected_scale, expected_zero_point = calculate_qparams(
        both[[both.argmin()]], both[[both.argmax()]], bits, symmetric
    )
    np.testing.assert_array_equal(scale, expected_scale)
    np.testing.assert_array_equal(zero_point, expected_zero_point)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    numel=st.integers(1, 2000),
    channel_size=st.integers(1, 600),
    bits=st.integers(2, 8),
    scheme=st.sampled_from([Scheme.PER_CHANNEL_AFFINE, Scheme.PER_CHANNEL_SYMMETRIC]),
)
def test_per_channel_observer_matches_per_channel_encode(
    seed: int, numel: int, channel_size: int, bits: int, scheme: Scheme
) -> None:
    x = (np.random.default_rng(seed).standard_normal(numel) + 0.3).astype(np.float32)
    config = QuantConfig(scheme=scheme, bits=bits, channel_size=channel_size)
    observer = observer_for(config)

    observer.observe(x)
    qparams = observer.calculate_qparams()
    fused = encode(x, config)
    observed = encode(x, config, qparams=qparams)

    assert isinstance(observer, PerChannelMinMaxObserver)
    np.testing.assert_array_equal(qparams[0], fused.scale)
    np.testing.assert_array_equal(qparams[1], fused.zero_point)
    np.testing.assert_array_equal(observed.payload, fused.payload)


@pytest.mark.parametrize("per_channel", [False, True])
def test_moving_average_follows_the_hand_computed_formula(per_channel: bool) -> None:
    observer = (
        MovingAveragePerChannelMinMaxObserver(averaging_constant=0.25, channel_size=2)
        if per_channel
        else MovingAverageMinMaxObserver(averaging_constant=0.25)
    )

    observer.observe(np.array([-2.0, 4.0], np.float32))
    observer.observe(np.array([-1.0, 8.0], np.float32))
    scale, zero_point = observer.calculate_qparams()

    # min: -2 + 0.25 * (-1 - -2) = -1.75; max: 4 + 0.25 * (8 - 4) = 5.
    assert observer.min_val is not None
    assert observer.max_val is not None
    np.testing.assert_array_equal(observer.min_val, [-1.75])
    np.testing.assert_array_equal(observer.max_val, [5.0])
    # scale = 6.75 / 255; zero point = round(1.75 / scale) = round(66.1) = 66.
    np.testing.assert_array_equal(scale, [np.float32(6.75 / 255)])
    np.testing.assert_array_equal(zero_point, [66])


def test_percentile_observer_clips_an_outlier() -> None:
    x = np.random.default_rng(0).standard_normal(999).astype(np.float32)
    x = np.append(x, np.float32(1000.0))
    clipped, full = PercentileObserver(percentile=99.0), MinMaxObserver()

    clipped.observe(x)
    full.observe(x)
    clipped_scale, clipped_zero_point = clipped.calculate_qparams()
    full_scale, _ = full.calculate_qparams()

    assert clipped.max_val is not None
    assert clipped.max_val[0] < 10.0
    assert clipped_scale[0] < full_scale[0] / 50
    q = encode(x, QuantConfig(Scheme.PER_TENSOR_AFFINE), qparams=(clipped_scale, clipped_zero_point))
    # The outlier saturates at the top level instead of stretching the grid.
    assert q.payload[-1] == 255
    assert decode(q)[-1] < 10.0


@pytest.mark.parametrize(
    "observer_type", [MinMaxObserver, PerChannelMinMaxObserver, PercentileObserver], ids=class_name
)
@pytest.mark.parametrize(("bad", "shown"), [(np.nan, "nan"), (np.inf, "inf")])
def test_observers_reject_non_finite_input(observer_type: type[MinMaxObserver], bad: float, shown: str) -> None:
    with pytest.raises(ValueError, match=re.escape("x[2]=") + r"\S*" + shown):
        observer_type().observe(np.array([0.0, 1.0, bad, 3.0], np.float32))


@pytest.mark.parametrize(
    "observer_type", [PerChannelMinMaxObserver, MovingAveragePerChannelMinMaxObserver], ids=class_name
)
def test_per_channel_observers_reject_a_changed_channel_count(
    observer_type: type[PerChannelMinMaxObserver | MovingAveragePerChannelMinMaxObserver],
) -> None:
    observer = observer_type(channel_size=4)
    observer.observe(np.ones(8, np.float32))

    with pytest.raises(ValueError, match=re.escape("observed 3 channels after 2")):
        observer.observe(np.ones(12, np.float32))


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: MovingAverageMinMaxObserver(averaging_constant=0.0), "averaging_constant=0.0"),
        (lambda: PercentileObserver(percentile=50.0), "percentile=50.0"),
        (lambda: MinMaxObserver(bits=9), "bits=9"),
        (lambda: calculate_qparams(np.array([2.0]), np.array([1.0])), "min_vals[0]=2.0 > max_vals[0]=1.0"),
    ],
)
def test_observer_arguments_are_validated(build: Any, expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        build()


# Every observer, per-channel ones with 4-element channels.
ALL_OBSERVERS: list[Any] = [
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    lambda: PerChannelMinMaxObserver(channel_size=4),
    lambda: MovingAveragePerChannelMinMaxObserver(channel_size=4),
    PercentileObserver,
]
OBSERVER_IDS = ["min_max", "moving_average", "per_channel", "moving_average_per_channel", "percentile"]


@pytest.mark.parametrize("make_observer", ALL_OBSERVERS, ids=OBSERVER_IDS)
@pytest.mark.parametrize("bad", [2.0**126, -(2.0**127), float(np.finfo(np.float32).max)])
def test_every_observer_refuses_finite_values_encode_refuses_naming_the_index(make_observer: Any, bad: float) -> None:
    # Index 9 sits in the third 4-element channel, after two good ones.
    x = np.arange(12, dtype=np.float32)
    x[9] = bad
    observer = make_observer()
    with pytest.raises(ValueError, match=re.escape("x[9]=") + r"\S+ cannot be observed; expected finite values"):
        observer.observe(x)
    assert observer.min_val is None  # nothing half-observed is kept
    with pytest.raises(ValueError, match=re.escape("x[9]=")):
        encode(x, QuantConfig(channel_size=4))


@pytest.mark.parametrize("field", ["min_vals", "max_vals"])
def test_calculate_qparams_refuses_ranges_past_2_to_the_126(field: str) -> None:
    ranges = {"min_vals": np.array([-1.0, -1.0], np.float32), "max_vals": np.array([1.0, 1.0], np.float32)}
    ranges[field][1] = 2.0**126 if field == "max_vals" else -(2.0**126)
    with pytest.raises(ValueError, match=re.escape(f"{field}[1]=") + r"\S+ is out of range; expected finite values"):
        calculate_qparams(ranges["min_vals"], ranges["max_vals"])


@pytest.mark.parametrize(("bits", "expected"), [(1, 128), (2, 128), (3, 512), (4, 512), (8, 512)])
def test_default_channel_size_is_smaller_at_one_and_two_bits(bits: int, expected: int) -> None:
    assert QuantConfig(bits=bits).channel_size == expected
    assert QuantConfig(bits=bits, channel_size=64).channel_size == 64  # an explicit size always wins
