"""Numba kernels behind the scaled-sign codec: channel means and sign bits in one pass per channel.

Imported on the first sign encode or decode (numba costs ~0.5 s to import);
compiled code is cached on disk like ``gradq.qcore._kernels``.
"""

import math

import numpy as np
from numba import njit

from gradq.qcore._kernels import channel_range, unpack
from gradq.qcore.codecs.sign import FIXED_POINT_BITS, SMALLEST_SCALE


@njit(cache=True, nogil=True)
def encode_signs(x, channel_size, scales, payload):  # type: ignore[no-untyped-def]
    """Each channel's exact mean ``|x|`` into ``scales``, bit i of ``payload`` = ``x[i] >= 0`` (LSB first).

    The mean is the numpy reference's: every ``|x|`` floored to a count of
    ``2**(e - FIXED_POINT_BITS)`` (``e`` the frexp exponent of the channel's
    largest ``|x|``), summed in int64, so the order of the sum does not matter.
    Returns the first channel holding NaN/Inf or ``|x| >= 2**126``, or -1.
    """
    for c in range(scales.size):
        start = c * channel_size
        stop = min(start + channel_size, x.size)
        lo, hi, in_range = channel_range(x, start, stop)
        if not in_range:
            return c
        _, exponent = math.frexp(max(-float(lo), float(hi)))
        per_unit = math.ldexp(1.0, FIXED_POINT_BITS - exponent)  # exact: a power of two
        count = np.int64(0)
        xs = x[start:stop]
        for i in range(xs.size):
            count += np.int64(math.floor(abs(float(xs[i])) * per_unit))
        scale = np.float32(float(count) / per_unit / (stop - start))
        scales[c] = max(scale, np.float32(SMALLEST_SCALE))
    full = x.size // 8
    for b in range(full):
        byte = np.uint8(0)
        for j in range(8):
            byte |= np.uint8(x[8 * b + j] >= 0) << np.uint8(j)
        payload[b] = byte
    if full < payload.size:
        byte = np.uint8(0)
        for j in range(x.size - 8 * full):
            byte |= np.uint8(x[8 * full + j] >= 0) << np.uint8(j)
        payload[full] = byte
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
