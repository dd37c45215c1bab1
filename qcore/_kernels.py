"""Fused numba kernels behind qcore: one pass per job, no Python loop over channels.

Importing this module imports numba, so qcore imports it only on first use;
compiled code is cached on disk (numba's ``cache=True``: beside this file when
it is writable, else in the user's cache directory).
"""

import numpy as np
from llvmlite import ir

from gradq.qcore._numba_target import prefer_wide_vectors

prefer_wide_vectors()  # before numba is first imported: it reads the target's features then
from numba import njit, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

_FLOAT32_SMALLEST = float(np.finfo(np.float32).smallest_subnormal)
# |x| >= 2**126 is refused like NaN/Inf, so the grid's ends, and so decoded
# values, stay below float32's maximum. In the sign-folded keys below (one
# order for every float bit pattern) exactly the keys in [_LOWEST_KEY,
# _HIGHEST_KEY) are in range: NaNs and infinities of either sign fold past
# the ends, so a channel's min and max keys decide it without another pass.
_HIGHEST_KEY = np.int32(0x7E800000)  # the bits of +2**126
_LOWEST_KEY = np.int32(-0x7E800000)  # the key of the in-range float nearest -2**126
# Elements per block of the blocked kernels (whole channels, at least one): a
# block's 32 KB of float32 is still in L1/L2 when its quantizing loop rereads it.
BLOCK_ELEMENTS = 8192


@njit(cache=True, nogil=True)
def qparams_from_range(lo: float, hi: float, qmax: int, symmetric: bool, stochastic: bool) -> tuple[np.float32, int]:
    """The one formula from (min, max) to (scale, zero_point), seed 000's generalised.

    The range is widened to include 0 (as torch's observers do) so 0.0 is always a
    level; for ranges that already contain 0 this is exactly the seed's arithmetic
    (scale in float64, zero point rounded half-to-even against it, scale sent as
    float32). A constant non-zero range gets scale |v| so that v is one level away
    from the zero point and round-trips exactly.

    Stochastic rounding must never clamp, or it is biased at the ends: its grid
    gets one spare step (affine: the zero point is rounded up, so the rounded grid
    still covers [min, max]; symmetric: the positive side, one level shorter,
    sets the step). At 1 bit affine there is no spare step to give.
    """
    mid = (qmax + 1) // 2
    if lo == hi:
        if lo == 0.0:
            return np.float32(1.0), (mid if symmetric else 0)
        # v sits one level above (v > 0) or below (v < 0) the zero point.
        return np.float32(abs(lo)), (mid if symmetric else (0 if lo > 0.0 else 1))
    lo = min(lo, 0.0)
    hi = max(hi, 0.0)
    if symmetric:
        scale = max(-lo, hi) / ((qmax - mid) if stochastic else (qmax / 2.0))
        zero_point = mid
    elif stochastic and qmax > 1:
        scale = (hi - lo) / (qmax - 1)
        zero_point = min(int(np.ceil(-lo / scale)), qmax)
    else:
        scale = (hi - lo) / qmax
        zero_point = min(max(int(np.rint(-lo / scale)), 0), qmax)
    # A scale that underflows float32 to 0 would make x / scale infinite.
    return np.float32(max(scale, _FLOAT32_SMALLEST)), zero_point


@njit(cache=True, nogil=True)
def qparams_from_ranges(lows, highs, qmax, symmetric, scales, zero_points):  # type: ignore[no-untyped-def]
    """Vectorised ``qparams_from_range`` (round-to-nearest grid) over per-channel ranges."""
    for c in range(lows.size):
        scales[c], zero_points[c] = qparams_from_range(float(lows[c]), float(highs[c]), qmax, symmetric, False)


@intrinsic
def _float32_from_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """The float32 whose bit pattern is the int32 ``bits``: a register move, no array allocated."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@njit(cache=True, nogil=True, inline="always")
def _key_of_bits(b):  # type: ignore[no-untyped-def]
    """Sign-folded order key of a float32's int32 bits (an involution: it also maps a key back to bits).

    Every step is cast back to int32: numba widens int32 arithmetic to int64,
    which halves the lanes of the vectorised reductions below.
    """
    return np.int32(b ^ (np.int32(b >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@njit(cache=True, nogil=True, inline="always")
def _float_of_key(key):  # type: ignore[no-untyped-def]
    return _float32_from_bits(_key_of_bits(np.int32(key)))  # type: ignore[call-arg]  # numba supplies typingctx


@njit(cache=True, nogil=True, inline="always")
def channel_range(x, start, stop):  # type: ignore[no-untyped-def]
    """Min, max and an in-range flag (finite, |x| < 2**126) of x[start:stop] in one pass.

    Floats are compared as sign-folded int32 keys (same order for finite values):
    integer min/max reductions vectorise where float ones do not, and the
    range test then reads the two extreme keys (see ``_HIGHEST_KEY``).
    """
    bit_view = x[start:stop].view(np.int32)
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    for i in range(bit_view.size):
        key = _key_of_bits(bit_view[i])
        lo = min(lo, key)
        hi = max(hi, key)
    return _float_of_key(lo), _float_of_key(hi), lo >= _LOWEST_KEY and hi < _HIGHEST_KEY


@njit(cache=True, nogil=True)
def ranges_per_channel(x, channel_size, lows, highs):  # type: ignore[no-untyped-def]
    """Per-channel min/max of a flat float32 array; returns the first non-finite channel or -1."""
    for c in range(lows.size):
        start = c * channel_size
        stop = min(start + channel_size, x.size)
        lo, hi, finite = channel_range(x, start, stop)
        if not finite:
            return c
        lows[c] = lo
        highs[c] = hi
    return -1


@njit(cache=True, nogil=True, inline="always")
def _uniform(key, index):  # type: ignore[no-untyped-def]
    """A counter-based uniform in [0, 1): splitmix64 of (key, index), 24 bits kept."""
    z = np.uint64(key) + np.uint64(index) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.float32(z >> np.uint64(40)) * np.float32(1.0 / (1 << 24))


@njit(cache=True, nogil=True, inline="always")
def quantize_channel(x, start, stop, scale, zero_point, qmax, noise_key, levels):  # type: ignore[no-untyped-def]
    """levels[i] = clamp(round(x[i] / scale) + zero_point, 0, qmax) for i in [start, stop).

    Division (not multiplication by 1/scale) keeps payloads byte-identical to
    seed 000; ``noise_key < 0`` means round-to-nearest-even, else stochastic.
    """
    # Loops run over 0-based slices: numba then drops the negative-index
    # wraparound and LLVM vectorises them (10x on this kind of machine).
    xs = x[start:stop]
    out = levels[start:stop]
    zf = np.float32(zero_point)
    top = np.float32(qmax)
    zero = np.float32(0.0)
    if noise_key < 0:
        for i in range(xs.size):
            q = np.rint(xs[i] / scale) + zf
            out[i] = np.uint8(min(max(q, zero), top))
    else:
        for i in range(xs.size):
            q = np.floor(xs[i] / scale + _uniform(noise_key, start + i)) + zf
            out[i] = np.uint8(min(max(q, zero), top))


@njit(cache=True, nogil=True)
def quantize_fused(x, channel_size, qmax, symmetric, noise_key, levels, scales, zero_points):  # type: ignore[no-untyped-def]
    """Observe, derive qparams and quantize a block of channels while it is still in cache.

    Each block (``BLOCK_ELEMENTS`` elements, whole channels) is observed and
    its qparams derived channel by channel, then quantized: the qparams'
    scalar float64 arithmetic of one channel overlaps the next channel's
    min/max instead of stalling its own quantize loop.
    Returns the index of the first channel holding a NaN/Inf, or -1.
    """
    stochastic = noise_key >= 0
    per_block = max(BLOCK_ELEMENTS // channel_size, 1)
    for first in range(0, scales.size, per_block):
        last = min(first + per_block, scales.size)
        for c in range(first, last):
            start = c * channel_size
            lo, hi, finite = channel_range(x, start, min(start + channel_size, x.size))
            if not finite:
                return c
            scales[c], zero_points[c] = qparams_from_range(float(lo), float(hi), qmax, symmetric, stochastic)
        for c in range(first, last):
            start = c * channel_size
            stop = min(start + channel_size, x.size)
            quantize_channel(x, start, stop, scales[c], zero_points[c], qmax, noise_key, levels)
    return -1


@njit(cache=True, nogil=True)
def quantize_with_qparams(x, channel_size, qmax, noise_key, scales, zero_points, levels):  # type: ignore[no-untyped-def]
    """Quantize with given qparams (from an observer); returns first non-finite channel or -1."""
    for c in range(scales.size):
        start = c * channel_size
        stop = min(start + channel_size, x.size)
        if start < stop and not channel_range(x, start, stop)[2]:
            return c
        quantize_channel(x, start, stop, scales[c], zero_points[c], qmax, noise_key, levels)
    return -1


@njit(cache=True, nogil=True)
def pack(levels, bits, out):  # type: ignore[no-untyped-def]
    """Pack ``bits``-bit levels LSB-first: level i occupies bits [i*bits, (i+1)*bits).

    Widths that divide a byte (1, 2, 4) pack whole bytes in a loop LLVM
    vectorises; the others put each group of eight levels through one 64-bit word.
    """
    if bits == 4 or bits == 2 or bits == 1:
        _pack_whole_bytes(levels, bits, out)
        return
    groups = levels.size // 8
    for g in range(groups):
        word = np.uint64(0)
        for j in range(8):
            word |= np.uint64(levels[g * 8 + j]) << np.uint64(j * bits)
        for b in range(bits):
            out[g * bits + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(0xFF))
    out[groups * bits :] = 0
    for i in range(groups * 8, levels.size):
        offset = i * bits
        word16 = np.uint16(levels[i]) << (offset & 7)
        out[offset >> 3] |= np.uint8(word16 & 0xFF)
        if (offset & 7) + bits > 8:
            out[(offset >> 3) + 1] |= np.uint8(word16 >> 8)


@njit(cache=True, nogil=True)
def _pack_whole_bytes(levels, bits, out):  # type: ignore[no-untyped-def]
    """``pack`` for bits in (1, 2, 4): byte i holds levels [i * per, (i + 1) * per), per = 8 // bits."""
    per = 8 // bits
    full = levels.size // per
    # Fixed-width bodies: a constant stride is what lets the loads vectorise.
    if bits == 4:
        for i in range(full):
            out[i] = levels[2 * i] | (levels[2 * i + 1] << 4)
    elif bits == 2:
        for i in range(full):
            out[i] = levels[4 * i] | (levels[4 * i + 1] << 2) | (levels[4 * i + 2] << 4) | (levels[4 * i + 3] << 6)
    else:
        for i in range(full):
            byte = np.uint8(0)
            for j in range(8):
                byte |= levels[8 * i + j] << j
            out[i] = byte
    if full < out.size:  # the last, partly filled byte
        byte = np.uint8(0)
        for j in range(levels.size - full * per):
            byte |= levels[full * per + j] << (j * bits)
        out[full] = byte


@njit(cache=True, nogil=True)
def _unpack_whole_bytes(payload, bits, levels):  # type: ignore[no-untyped-def]
    """``unpack`` for bits in (1, 2, 4)."""
    per = 8 // bits
    full = levels.size // per
    mask = np.uint8((1 << bits) - 1)
    if bits == 4:
        for i in range(full):
            byte = payload[i]
            levels[2 * i] = byte & mask
            levels[2 * i + 1] = byte >> 4
    elif bits == 2:
        for i in range(full):
            byte = payload[i]
            levels[4 * i] = byte & mask
            levels[4 * i + 1] = (byte >> 2) & mask
            levels[4 * i + 2] = (byte >> 4) & mask
            levels[4 * i + 3] = byte >> 6
    else:
        for i in range(full):
            byte = payload[i]
            for j in range(8):
                levels[8 * i + j] = (byte >> j) & mask
    for j in range(levels.size - full * per):
        levels[full * per + j] = (payload[full] >> (j * bits)) & mask


@njit(cache=True, nogil=True)
def unpack(payload, bits, levels):  # type: ignore[no-untyped-def]
    """Inverse of ``pack``: fills ``levels`` (its size is the element count)."""
    if bits == 4 or bits == 2 or bits == 1:
        _unpack_whole_bytes(payload, bits, levels)
        return
    mask = np.uint64((1 << bits) - 1)
    groups = levels.size // 8
    for g in range(groups):
        word = np.uint64(0)
        for b in range(bits):
            word |= np.uint64(payload[g * bits + b]) << np.uint64(8 * b)
        for j in range(8):
            levels[g * 8 + j] = np.uint8((word >> np.uint64(j * bits)) & mask)
    for i in range(groups * 8, levels.size):
        offset = i * bits
        word16 = np.uint16(payload[offset >> 3])
        if (offset & 7) + bits > 8:
            word16 |= np.uint16(payload[(offset >> 3) + 1]) << 8
        levels[i] = np.uint8((word16 >> (offset & 7)) & ((1 << bits) - 1))


@njit(cache=True, nogil=True)
def dequantize_into(payload, bits, channel_size, scales, zero_points, out, accumulate, divisor):  # type: ignore[no-untyped-def]
    """out[i] (+)= scale_c * (level_i - zero_point_c); an accumulated sum is then / divisor unless it is 1.

    Below 8 bits the payload is first unpacked to one byte per level: two simple
    vectorised passes beat one pass with per-element bit arithmetic.
    """
    if bits == 8:
        levels = payload
    else:
        levels = np.empty(out.size, np.uint8)
        unpack(payload, bits, levels)
    for c in range(scales.size):
        start = c * channel_size
        stop = min(start + channel_size, out.size)
        s = scales[c]
        z = np.float32(zero_points[c])
        # 0-based slices vectorise, see quantize_channel.
        src = levels[start:stop]
        dest = out[start:stop]
        if accumulate and divisor != 1:
            for i in range(dest.size):
                dest[i] = (dest[i] + s * (np.float32(src[i]) - z)) / divisor
        elif accumulate:
            for i in range(dest.size):
                dest[i] += s * (np.float32(src[i]) - z)
        else:
            for i in range(dest.size):
                dest[i] = s * (np.float32(src[i]) - z)


@njit(cache=True, nogil=True)
def quantize_compensated(x, residual, channel_size, qmax, symmetric, noise_key, levels, scales, zero_points):  # type: ignore[no-untyped-def]
    """Error feedback fused into ``quantize_fused``: ``residual <- c - dequantize(quantize(c))``, c = x + residual.

    Each block of channels (as in ``quantize_fused``) is compensated,
    observed, quantized and its new residual written while it is still in
    cache; the float32 arithmetic is that of adding, ``quantize_fused`` and
    ``dequantize_into`` one after the other. Returns the index of the first
    channel whose compensated values hold a NaN/Inf, or -1; the residual is
    then partly overwritten.
    """
    stochastic = noise_key >= 0
    per_block = max(BLOCK_ELEMENTS // channel_size, 1)
    for first in range(0, scales.size, per_block):
        last = min(first + per_block, scales.size)
        for c in range(first, last):
            start = c * channel_size
            stop = min(start + channel_size, x.size)
            # 0-based slices vectorise, see quantize_channel.
            xs = x[start:stop]
            rs = residual[start:stop]
            for i in range(rs.size):
                rs[i] = xs[i] + rs[i]
            lo, hi, finite = channel_range(residual, start, stop)
            if not finite:
                return c
            scales[c], zero_points[c] = qparams_from_range(float(lo), float(hi), qmax, symmetric, stochastic)
        for c in range(first, last):
            start = c * channel_size
            stop = min(start + channel_size, x.size)
            scale = scales[c]
            quantize_channel(residual, start, stop, scale, zero_points[c], qmax, noise_key, levels)
            z = np.float32(zero_points[c])
            rs = residual[start:stop]
            src = levels[start:stop]
            for i in range(rs.size):
                rs[i] = rs[i] - scale * (np.float32(src[i]) - z)
    return -1


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _squared_error_block(levels, begin, end, channel_size, scales, zero_points, reference):  # type: ignore[no-untyped-def]
    """(sum of (dequantized - reference)^2, sum of reference^2) over elements [begin, end), ``levels`` theirs.

    Each channel's part of the block is summed in float32 (at most ``BLOCK_ELEMENTS`` terms, in any order:
    the sums vectorise), the parts in float64.
    """
    error = 0.0
    norm = 0.0
    for c in range(begin // channel_size, (end - 1) // channel_size + 1):
        start = max(c * channel_size, begin)
        stop = min(c * channel_size + channel_size, end)
        s = scales[c]
        z = np.float32(zero_points[c])
        # 0-based slices vectorise, see quantize_channel.
        src = levels[start - begin : stop - begin]
        want = reference[start:stop]
        channel_error = np.float32(0.0)
        channel_norm = np.float32(0.0)
        for i in range(want.size):
            w = want[i]
            d = s * (np.float32(src[i]) - z) - w
            channel_error += d * d
            channel_norm += w * w
        error += float(channel_error)
        norm += float(channel_norm)
    return error, norm


@njit(cache=True, nogil=True)
def dequantize_error(payload, bits, channel_size, scales, zero_points, reference):  # type: ignore[no-untyped-def]
    """(||dequantized - reference||^2, ||reference||^2) in one pass, writing no array the size of ``reference``.

    The dequantized values are ``dequantize_into``'s (float32, the same expression); block by block, the levels
    of a packed payload are unpacked into a buffer of ``BLOCK_ELEMENTS``.
    """
    total_error = 0.0
    total_norm = 0.0
    levels = np.empty(min(BLOCK_ELEMENTS, reference.size), np.uint8)
    for begin in range(0, reference.size, BLOCK_ELEMENTS):
        end = min(begin + BLOCK_ELEMENTS, reference.size)
        # Two calls: a read-only payload and the buffer are arrays of different numba types.
        if bits == 8:
            error, norm = _squared_error_block(
                payload[begin:end], begin, end, channel_size, scales, zero_points, reference
            )
        else:
            block = levels[: end - begin]
            unpack(payload[begin * bits // 8 : (end * bits + 7) // 8], bits, block)
            error, norm = _squared_error_block(block, begin, end, channel_size, scales, zero_points, reference)
        total_error += error
        total_norm += norm
    return total_error, total_norm
