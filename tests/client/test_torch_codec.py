"""The device-side torch quantizer produces qcore's exact bytes (checked on CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.client.torch_codec import quantize_tensor
from gradq.qcore import QuantConfig, Rounding, Scheme, decode, encode

QUANTIZED = [
    Scheme.PER_TENSOR_AFFINE,
    Scheme.PER_TENSOR_SYMMETRIC,
    Scheme.PER_CHANNEL_AFFINE,
    Scheme.PER_CHANNEL_SYMMETRIC,
]


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, QuantConfig]:
    scheme = draw(st.sampled_from(QUANTIZED))
    bits = draw(st.integers(2 if scheme.is_symmetric else 1, 8))
    config = QuantConfig(scheme=scheme, bits=bits, channel_size=draw(st.integers(1, 700)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    numel = draw(st.integers(0, 3000))
    values = (rng.normal(size=numel) * 10.0 ** draw(st.integers(-12, 6)) + draw(st.floats(-1, 1))).astype(np.float32)
    if numel and draw(st.booleans()):
        values[: numel // 3] = values[0]  # constant runs, including whole constant channels
    if numel and draw(st.booleans()):
        values[rng.random(numel) < 0.3] = 0.0
    return values, config


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_payload_scale_zero_point_and_decode_are_identical_to_qcore(case: tuple[np.ndarray, QuantConfig]) -> None:
    values, config = case
    expected = encode(values, config)
    actual, dequantized = quantize_tensor(torch.from_numpy(values), config)
    assert actual.payload.tobytes() == expected.payload.tobytes()
    np.testing.assert_array_equal(actual.scale, expected.scale)
    np.testing.assert_array_equal(actual.zero_point, expected.zero_point)
    assert (actual.numel, actual.channel_size, actual.bits, actual.scheme) == (
        expected.numel,
        expected.channel_size,
        expected.bits,
        expected.scheme,
    )
    np.testing.assert_array_equal(dequantized.numpy(), decode(expected))


def test_dtype_is_recorded_for_the_receiver() -> None:
    encoded, _ = quantize_tensor(torch.ones(10, dtype=torch.bfloat16), QuantConfig())
    assert encoded.dtype == "bfloat16"
    assert quantize_tensor(torch.ones(4), QuantConfig(), dtype="float16")[0].dtype == "float16"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.0**127])
def test_refuses_values_qcore_refuses_with_the_same_message(bad: float) -> None:
    values = torch.tensor([0.0, 1.0, bad, 2.0])
    with pytest.raises(ValueError, match=r"x\[2\]=.* cannot be encoded; expected finite values with \|x\| < 2\*\*126"):
        quantize_tensor(values, QuantConfig(channel_size=2))
    with pytest.raises(ValueError, match=r"x\[2\]="):
        encode(values.numpy(), QuantConfig(channel_size=2))


@pytest.mark.parametrize(
    "config",
    [QuantConfig(scheme=Scheme.FLOAT16), QuantConfig(rounding=Rounding.STOCHASTIC)],
    ids=["float16", "stochastic"],
)
def test_unsupported_configs_are_refused(config: QuantConfig) -> None:
    with pytest.raises(ValueError, match="is not supported on the device"):
        quantize_tensor(torch.ones(3), config)
