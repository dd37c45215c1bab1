"""Every kernel that observes a channel refuses exactly the floats with not |x| < 2**126, whatever their bits.

The kernels decide a channel from its two extreme sign-folded keys alone, so
each float bit pattern at the edge of that rule (both signs of 2**126 and its
neighbours, infinities, NaNs with any payload, zeros, subnormals) is put in a
channel of ordinary values and sent through each path that observes ranges.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

from gradq.qcore import ErrorFeedback, QuantConfig, QuantizedArray, Scheme, encode

BIT_PATTERNS = [
    0x00000000,  # +0
    0x80000000,  # -0
    0x00000001,  # smallest subnormal
    0x80000001,
    0x3F800000,  # 1.0
    0x7E7FFFFF,  # largest float below 2**126
    0xFE7FFFFF,
    0x7E800000,  # 2**126
    0xFE800000,
    0x7E800001,
    0xFE800001,
    0x7F7FFFFF,  # float32's maximum
    0xFF7FFFFF,
    0x7F800000,  # infinities
    0xFF800000,
    0x7F800001,  # NaNs: signalling, quiet, either sign, largest payload
    0x7FC00000,
    0xFFC00000,
    0x7FFFFFFF,
    0xFFFFFFFF,
]

CHANNEL = 64
INDEX = 70  # in the second channel, not at its start


def with_pattern(bits: int) -> np.ndarray:
    """Three channels of ordinary values with the float of ``bits`` at ``INDEX``."""
    x = np.linspace(-2.0, 3.0, 3 * CHANNEL, dtype=np.float32)
    x.view(np.uint32)[INDEX] = bits
    return x


def plain(scheme: Scheme) -> Callable[[np.ndarray], QuantizedArray]:
    config = QuantConfig(scheme=scheme, bits=4, channel_size=CHANNEL)
    return lambda x: encode(x, config)


def compensated(scheme: Scheme) -> Callable[[np.ndarray], QuantizedArray]:
    config = QuantConfig(scheme=scheme, bits=4, channel_size=CHANNEL)
    return lambda x: ErrorFeedback().encode("bucket", x, config)


def observed(scheme: Scheme) -> Callable[[np.ndarray], QuantizedArray]:
    config = QuantConfig(scheme=scheme, bits=8, channel_size=CHANNEL)
    qparams = (np.full(3, 0.05, np.float32), np.full(3, 128, np.int32))
    return lambda x: encode(x, config, qparams=qparams)


PATHS = {
    "per-channel affine": plain(Scheme.PER_CHANNEL_AFFINE),
    "per-tensor symmetric": plain(Scheme.PER_TENSOR_SYMMETRIC),
    "per-channel affine, error feedback": compensated(Scheme.PER_CHANNEL_AFFINE),
    "per-channel affine, observer qparams": observed(Scheme.PER_CHANNEL_AFFINE),
    "scaled sign": plain(Scheme.PER_CHANNEL_SIGN),
    "scaled sign, error feedback": compensated(Scheme.PER_CHANNEL_SIGN),
}


@pytest.mark.parametrize("path", PATHS, ids=str)
@pytest.mark.parametrize("bits", BIT_PATTERNS, ids=lambda bits: f"{bits:#010x}")
def test_a_value_is_refused_exactly_when_it_is_not_below_2_to_the_126(path: str, bits: int) -> None:
    x = with_pattern(bits)
    value = float(x[INDEX])
    refused = not abs(value) < 2.0**126

    if refused:
        with pytest.raises(ValueError, match=re.escape(f"x[{INDEX}]=")):
            PATHS[path](x)
    else:
        encoded = PATHS[path](x)
        assert encoded.numel == x.size, f"{path} dropped elements of {value!r}"
