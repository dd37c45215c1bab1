"""Dense bit packing of quantization levels: ``bits`` bits per level, LSB first."""

from __future__ import annotations

import numpy as np

__all__ = ["channel_count", "pack_bits", "unpack_bits", "packed_size"]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} is out of range; expected an integer in 1..8")


def packed_size(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` levels of ``bits`` bits: ``ceil(numel * bits / 8)``."""
    return (numel * bits + 7) // 8


def channel_count(numel: int, channel_size: int) -> int:
    """Channels of ``channel_size`` consecutive elements that cover ``numel``: ``ceil(numel / channel_size)``.

    The last channel may be shorter; every layer that cuts a flat array into
    channels (codecs, observers, chunking) counts them here.
    """
    return -(-numel // channel_size)


def pack_bits(levels: np.ndarray, bits: int) -> np.ndarray:
    """Pack levels densely: level i occupies bits [i*bits, (i+1)*bits) of the byte stream.

    Args:
        levels: integer array (any shape, flattened) with values in ``0..2**bits-1``.
        bits: bits per level, 1..8.

    Returns:
        uint8 array of ``ceil(levels.size * bits / 8)`` bytes.

    Raises:
        ValueError: if ``bits`` is out of range or a level does not fit in ``bits`` bits.
    """
    _check_bits(bits)
    flat = np.asarray(levels).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() > (1 << bits) - 1):
        bad = int(np.flatnonzero((flat < 0) | (flat > (1 << bits) - 1))[0])
        raise ValueError(f"levels[{bad}]={flat[bad]} does not fit in {bits} bits; expected 0..{(1 << bits) - 1}")
    flat = flat.astype(np.uint8, copy=False)
    if bits == 8:
        return flat.copy()
    out = np.empty(packed_size(flat.size, bits), np.uint8)
    from gradq.qcore import _kernels  # numba loads on first use

    _kernels.pack(np.ascontiguousarray(flat), bits, out)
    return out


def unpack_bits(buf: np.ndarray | bytes, bits: int, numel: int) -> np.ndarray:
    """Inverse of ``pack_bits``.

    Args:
        buf: the packed bytes (uint8 array or bytes).
        bits: bits per level, 1..8.
        numel: number of levels to read.

    Returns:
        uint8 array of ``numel`` levels.

    Raises:
        ValueError: if ``buf`` does not hold exactly ``ceil(numel * bits / 8)`` bytes.
    """
    _check_bits(bits)
    data = np.frombuffer(buf, np.uint8) if isinstance(buf, (bytes, bytearray, memoryview)) else np.asarray(buf)
    data = np.ascontiguousarray(data.reshape(-1), dtype=np.uint8)
    if numel < 0 or data.size != packed_size(numel, bits):
        raise ValueError(
            f"buffer has {data.size} bytes; expected ceil({numel} * {bits} / 8) = "
            f"{packed_size(max(numel, 0), bits)} for numel={numel}, bits={bits}"
        )
    if bits == 8:
        return data.copy()
    from gradq.qcore import _kernels  # numba loads on first use

    levels = np.empty(numel, np.uint8)
    _kernels.unpack(data, bits, levels)
    return levels
