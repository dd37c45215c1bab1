"""Numba kernels behind the scaled-sign codec: channel means and sign bits in one pass per channel.

Imported on the first sign encode or decode (numba costs ~0.5 s to import);
compiled code is cached on disk like ``gradq.qcore._kernels``, whose bit
packing the codec uses (``pack``, ``unpack``).
"""

import math

import numpy as np
from numba import njit

from gradq.qcore._kernels import channel_range, pack, unpack
from gradq.qcore.codecs.sign import FIXED_POINT_BITS, SMALLEST_SCALE

__all__ = ["decode_signs", "encode_signs", "encode_signs_compensated", "pack"]


@njit(cache=True, nogil=True, inline="always")
def _mean_magnitude(values, lo, hi):  # type: ignore[no-untyped-def]
    """The exact mean ``|v|`` of a channel whose min and max are (lo, hi), as a float32 scale > 0.

    The numpy reference's sum: every ``|v|`` floored to a count of
    ``2**(e - FIXED_POINT_BITS)`` (``e`` the frexp exponent of the channel's
    largest ``|v|``), summed in int64, so the order of the sum does not matter.
    """
    _, exponent = math.frexp(max(-float(lo), float(hi)))
    per_unit = math.ldexp(1.0, FIXED_POINT_BITS - exponent)  # exact: a power of two
    count = np.int64(0)
    for i in range(values.size):
        count += np.int64(math.floor(abs(float(values[i])) * per_unit))
    return max(np.float32(float(count) / per_unit / values.size), np.float32(SMALLEST_SCALE))


@njit(cache=True, nogil=True)
def encode_signs(x, channel_size, scales, signs):  # type: ignore[no-untyped-def]
    """Each channel's exact mean ``|x|`` into ``scales``, ``signs[i] = x[i] >= 0``.

    Returns the first channel holding NaN/Inf or ``|x| >= 2**126``, or -1.
    """
    for c in range(scales.size):
        start = c * channel_size
        stop = min(start + channel_size, x.size)
        lo, hi, in_range = channel_range(x, start, stop)
        if not in_range:
            return c
        xs = x[start:stop]
        scales[c] = _mean_magnitude(xs, lo, hi)
        out = signs[start:stop]
        for i in range(xs.size):
            out[i] = np.uint8(xs[i] >= 0)
    return -1


@njit(cache=True, nogil=True)
def encode_signs_compensated(x, residual, channel_size, scales, signs):  # type: ignore[no-untyped-def]
    """Error feedback fused into ``encode_signs``: c = x + residual is encoded, ``residual <- c - decode``.

    The float32 arithmetic is that of adding, encoding and decoding apart.
    Returns the first channel whose compensated values are out of range, or -1;
    channels before it already hold their new residual.
    """
    one = np.float32(1.0)
    two = np.float32(2.0)
    for c in range(scales.size):
        start = c * channel_size
        stop = min(start + channel_size, x.size)
        xs = x[start:stop]
        rs = residual[start:stop]
        for i in range(rs.size):
            rs[i] = xs[i] + rs[i]
        lo, hi, in_range = channel_range(residual, start, stop)
        if not in_range:
            return c
        s = _mean_magnitude(rs, lo, hi)
        scales[c] = s
        out = signs[start:stop]
        for i in range(rs.size):
            bit = np.uint8(rs[i] >= 0)
            out[i] = bit
            rs[i] = rs[i] - s * (two * np.float32(bit) - one)
    return -1


@njit(cache=True, nogil=True)
def decode_signs(payload, channel_size, scales, out, accumulate, divisor):  # type: ignore[no-untyped-def]
    """``out[i] (+)= +-scale_c`` by bit i; an accumulated sum is then ``/ divisor`` unless it is 1.

    The bits are unpacked to one byte each first: two vectorised passes beat
    one with per-element bit arithmetic (as in ``dequantize_into``).
    """
    bits = np.empty(out.size, np.uint8)
    unpack(payload, 1, bits)
    one = np.float32(1.0)
    two = np.float32(2.0)
    for c in range(scales.size):
        start = c * channel_size
        stop = min(start + channel_size, out.size)
        s = scales[c]
        # 0-based slices vectorise, see quantize_channel.
        src = bits[start:stop]
        dest = out[start:stop]
        if accumulate and divisor != 1:
            for i in range(dest.size):
                dest[i] = (dest[i] + s * (two * np.float32(src[i]) - one)) / divisor
        elif accumulate:
            for i in range(dest.size):
                dest[i] += s * (two * np.float32(src[i]) - one)
        else:
            for i in range(dest.size):
                dest[i] = s * (two * np.float32(src[i]) - one)
