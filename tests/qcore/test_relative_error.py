"""relative_error: the one-pass kernel of the uniform grids against decoding, subtracting and two norms."""

from __future__ import annotations

import numpy as np
import pytest

from gradq.qcore import QuantConfig, Scheme, decode, encode, relative_error
from gradq.qcore.codecs import registered_schemes


def _reference(values: np.ndarray, config: QuantConfig) -> tuple[float, float]:
    encoded = encode(values, config)
    norm = float(np.linalg.norm(values.astype(np.float64)))
    expected = float(np.linalg.norm(decode(encoded).astype(np.float64) - values)) / norm if norm > 0 else 0.0
    return relative_error(encoded, values), expected


@pytest.mark.parametrize("scheme", sorted(registered_schemes()))
@pytest.mark.parametrize("numel", [1, 7, 8191, 8192, 8193, 100_003])
def test_every_scheme_reports_what_decoding_and_two_norms_report(scheme: Scheme, numel: int) -> None:
    values = np.random.default_rng(numel).normal(0, 1e-2, numel).astype(np.float32)
    for config in {QuantConfig(scheme=scheme, bits=bits, channel_size=c) for bits in (3, 8) for c in (100, 512)}:
        got, expected = _reference(values, config)
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-9), config


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_packed_levels_are_read_across_block_and_channel_ends(bits: int) -> None:
    # 2^20 + 5 elements in channels of 333: channels straddle the kernel's 8192-element blocks, and the last
    # byte of the payload is partly filled.
    values = np.random.default_rng(bits).normal(0, 1, (1 << 20) + 5).astype(np.float32)
    got, expected = _reference(values, QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=bits, channel_size=333))
    assert got == pytest.approx(expected, rel=1e-5)


def test_a_zero_reference_loses_nothing_and_a_wrong_one_is_refused() -> None:
    zeros = np.zeros(4096, np.float32)
    encoded = encode(zeros, QuantConfig(bits=4))
    assert relative_error(encoded, zeros) == 0.0
    with pytest.raises(ValueError, match="reference has dtype=float64"):
        relative_error(encoded, zeros.astype(np.float64))
    with pytest.raises(ValueError, match="expected a contiguous float32 array of 4096 elements"):
        relative_error(encoded, zeros[:100])
