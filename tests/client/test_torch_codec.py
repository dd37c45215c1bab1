"""Every codec's torch twin produces qcore's exact bytes and decodes to qcore's exact values (on CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.qcore import ErrorFeedback, QuantConfig, Rounding, Scheme, codec_for, decode, encode
from gradq.qcore.torch_codec import TorchErrorFeedback, decode_tensor, encode_tensor


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, QuantConfig, int]:
    scheme = draw(st.sampled_from(list(Scheme)))
    bits = draw(st.integers(1, 8))
    rounding = draw(st.sampled_from(list(Rounding)))
    try:
        config = QuantConfig(scheme=scheme, bits=bits, channel_size=draw(st.integers(1, 700)), rounding=rounding)
    except ValueError:  # 1 bit on a symmetric grid
        config = QuantConfig(scheme=scheme, bits=2, rounding=rounding)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    numel = draw(st.integers(0, 3000))
    magnitude = 10.0 ** draw(st.integers(-12, 6 if scheme.is_quantized else 4))
    values = (rng.normal(size=numel) * magnitude + draw(st.floats(-1, 1))).astype(np.float32)
    if numel and draw(st.booleans()):
        values[: numel // 3] = values[0]  # constant runs, including whole constant channels
    if numel and draw(st.booleans()):
        values[rng.random(numel) < 0.3] = 0.0
    return values, config, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_every_codec_twin_encodes_and_decodes_exactly_as_qcore(case: tuple[np.ndarray, QuantConfig, int]) -> None:
    values, config, seed = case
    expected = encode(values, config, rng=np.random.default_rng(seed))
    actual = encode_tensor(torch.from_numpy(values), config, rng=np.random.default_rng(seed))
    assert actual.payload.tobytes() == expected.payload.tobytes()
    np.testing.assert_array_equal(actual.scale, expected.scale)
    np.testing.assert_array_equal(actual.zero_point, expected.zero_point)
    assert (actual.numel, actual.channel_size, actual.bits, actual.scheme) == (
        expected.numel,
        expected.channel_size,
        expected.bits,
        expected.scheme,
    )
    decoded = decode_tensor(expected, torch.full((values.size,), np.nan))
    np.testing.assert_array_equal(decoded.numpy(), decode(expected))


@pytest.mark.parametrize("scheme", list(Scheme), ids=lambda s: s.name.lower())
@pytest.mark.parametrize("rounding", list(Rounding), ids=lambda r: r.name.lower())
def test_torch_error_feedback_carries_the_numpy_residuals(scheme: Scheme, rounding: Rounding) -> None:
    config = QuantConfig(scheme=scheme, bits=2 if scheme.is_quantized else 8, channel_size=64, rounding=rounding)
    host, device = ErrorFeedback(), TorchErrorFeedback()
    host_rng, device_rng = np.random.default_rng(3), np.random.default_rng(3)
    steps = np.random.default_rng(4).normal(size=(4, 300)).astype(np.float32)
    for step in steps:
        sent = host.encode("bucket", step, config, rng=host_rng)
        device_sent = device.encode("bucket", torch.from_numpy(step), config, rng=device_rng)
        assert device_sent.payload.tobytes() == sent.payload.tobytes()
        device_residual = device.residual("bucket")
        assert device_residual is not None
        np.testing.assert_array_equal(device_residual.numpy(), host.residual("bucket"))
    assert list(device.keys()) == ["bucket"]


def test_dtype_is_recorded_for_the_receiver() -> None:
    assert encode_tensor(torch.ones(10, dtype=torch.bfloat16), QuantConfig()).dtype == "bfloat16"
    assert encode_tensor(torch.ones(4), QuantConfig(), dtype="float16").dtype == "float16"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.0**127])
@pytest.mark.parametrize("scheme", [Scheme.PER_CHANNEL_AFFINE, Scheme.PER_TENSOR_SYMMETRIC], ids=lambda s: s.name)
def test_refuses_values_qcore_refuses_with_the_same_message(bad: float, scheme: Scheme) -> None:
    values = torch.tensor([0.0, 1.0, bad, 2.0])
    config = QuantConfig(scheme=scheme, channel_size=2)
    with pytest.raises(ValueError, match=r"x\[2\]=.* cannot be encoded; expected finite values with \|x\| < 2\*\*126"):
        encode_tensor(values, config)
    with pytest.raises(ValueError, match=r"x\[2\]=.* cannot be encoded; expected finite values with \|x\| < 2\*\*126"):
        encode(values.numpy(), config)


def test_float16_refuses_what_would_arrive_as_inf_with_qcores_message() -> None:
    values = torch.tensor([1.0, 70000.0])
    with pytest.raises(ValueError, match=r"x\[1\]=70000.0 cannot be encoded; expected \|x\| <= 65504"):
        encode_tensor(values, QuantConfig(scheme=Scheme.FLOAT16))


def test_decode_refuses_a_wrong_output_tensor() -> None:
    encoded = encode(np.ones(8, np.float32), QuantConfig())
    with pytest.raises(ValueError, match="expected a contiguous float32 tensor of 8 elements"):
        decode_tensor(encoded, torch.empty(8, dtype=torch.float16))


def test_every_registered_codec_has_a_torch_twin() -> None:
    for scheme in Scheme:
        twin = codec_for(scheme).torch()
        assert callable(twin.encode) and callable(twin.decode)
