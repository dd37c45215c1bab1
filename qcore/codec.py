"""Encode a flat float array onto the wire grid and decode it back."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gradq.qcore.packing import packed_size
from gradq.qcore.scheme import QuantConfig, Rounding, Scheme

__all__ = [
    "QuantizedArray",
    "encode",
    "decode",
    "decode_accumulate",
    "fake_quantize",
    "wire_size",
    "METADATA_BYTES",
]

# Fixed fields of the wire message (scheme, bits, numel, channel_size, dtype tag,
# field headers); a deliberate upper bound so wire_size never under-reports.
METADATA_BYTES = 32


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedArray:
    """A flat array on the wire grid: levels packed densely plus their qparams.

    Attributes:
        scheme: the grid (or float pass-through) the payload is on.
        bits: bits per element in ``payload`` (16/32 for the float schemes).
        numel: number of elements encoded.
        channel_size: elements per channel (``numel`` for per-tensor schemes).
        scale: float32, one per channel (one for per-tensor; empty for floats).
        zero_point: int32, one per channel, each in ``0..2**bits-1``.
        payload: uint8 bytes, ``ceil(numel * bits / 8)`` of them.
        dtype: the sender's element type, so the receiver can cast back.
    """

    scheme: Scheme
    bits: int
    numel: int
    channel_size: int
    scale: np.ndarray
    zero_point: np.ndarray
    payload: np.ndarray
    dtype: str = "float32"

    @property
    def num_channels(self) -> int:
        """How many (scale, zero_point) pairs the array carries."""
        return int(self.scale.size)

    @property
    def nbytes(self) -> int:
        """Bytes this array occupies on the wire, metadata included."""
        return METADATA_BYTES + self.payload.nbytes + self.scale.nbytes + self.zero_point.nbytes


def _kernels():  # type: ignore[no-untyped-def]
    # numba costs ~0.5 s to import; pay it on the first encode, not on import.
    from gradq.qcore import _kernels

    return _kernels


def _as_flat_float32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).reshape(-1), dtype=np.float32)


def _num_channels(numel: int, config: QuantConfig) -> int:
    if not config.scheme.is_per_channel:
        return 1
    return -(-numel // config.channel_size)


def _noise_key(config: QuantConfig, rng: np.random.Generator | None) -> int:
    if config.rounding is not Rounding.STOCHASTIC:
        return -1
    generator = rng if rng is not None else np.random.default_rng(config.seed)
    return int(generator.integers(0, 2**62))


# Quantized schemes refuse |x| >= 2**126 (see _kernels): such gradients mean a diverged
# run, and refusing them keeps every decoded value finite.
LARGEST_QUANTIZABLE = float(2.0**126)
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def _raise_out_of_range(x: np.ndarray, limit: float, what: str, offset: int = 0) -> None:
    """Raise for the first element of ``x`` with ``not |x| < limit`` (NaN included)."""
    bad = ~(np.abs(x) < limit)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(f"x[{offset + index}]={float(x[index])} cannot be encoded; expected {what}")


def encode(
    x: np.ndarray,
    config: QuantConfig,
    *,
    qparams: tuple[np.ndarray, np.ndarray] | None = None,
    rng: np.random.Generator | None = None,
    dtype: str | None = None,
) -> QuantizedArray:
    """Quantize (or cast, for the float schemes) a flat array for the wire.

    Args:
        x: any float array; it is flattened (C order) and computed in float32.
        config: the scheme, bits, channel size and rounding.
        qparams: (scale, zero_point) from an observer, one per channel; None
            derives them from ``x`` itself in the same pass (min/max).
        rng: generator for stochastic rounding; None seeds one from ``config.seed``.
        dtype: element type to record for the receiver; defaults to ``x.dtype``.

    Returns:
        The QuantizedArray; its payload has ``ceil(numel * bits / 8)`` bytes.

    Raises:
        ValueError: if ``x`` holds NaN/Inf (naming the first such index) or
            ``qparams`` do not fit the config.
    """
    dtype = dtype or str(np.asarray(x).dtype)
    flat = _as_flat_float32(x)
    numel = flat.size
    scheme = config.scheme
    if not scheme.is_quantized:
        if scheme is Scheme.FLOAT16:
            _raise_out_of_range(flat, _FLOAT16_MAX + 16.0, f"|x| <= {_FLOAT16_MAX:g}, float16's largest")
        else:
            _raise_out_of_range(flat, float("inf"), "finite values (no NaN or Inf)")
        wire_type = np.float16 if scheme is Scheme.FLOAT16 else np.float32
        payload = flat.astype(wire_type).view(np.uint8)
        bits = 8 * np.dtype(wire_type).itemsize
        no_scale, no_zero_point = np.empty(0, np.float32), np.empty(0, np.int32)
        return QuantizedArray(scheme, bits, numel, numel, no_scale, no_zero_point, payload, dtype)
    channel_size = config.channel_size if scheme.is_per_channel else max(numel, 1)
    num_channels = _num_channels(numel, config)
    kernels = _kernels()
    levels = np.empty(numel, np.uint8)
    noise_key = _noise_key(config, rng)
    if qparams is None:
        scale = np.empty(num_channels, np.float32)
        zero_point = np.empty(num_channels, np.int32)
        if numel == 0:
            scale[:], zero_point[:] = kernels.qparams_from_range(0.0, 0.0, config.qmax, scheme.is_symmetric, False)
            bad = -1
        else:
            bad = kernels.quantize_fused(
                flat, channel_size, config.qmax, scheme.is_symmetric, noise_key, levels, scale, zero_point
            )
    else:
        scale, zero_point = _checked_qparams(qparams, num_channels, config)
        bad = kernels.quantize_with_qparams(flat, channel_size, config.qmax, noise_key, scale, zero_point, levels)
    if bad >= 0:
        start = bad * channel_size
        window = flat[start : start + channel_size]
        _raise_out_of_range(window, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126", start)
    if config.bits == 8:
        payload = levels
    else:
        payload = np.empty(packed_size(numel, config.bits), np.uint8)
        kernels.pack(levels, config.bits, payload)
    return QuantizedArray(scheme, config.bits, numel, channel_size, scale, zero_point, payload, dtype)


def _checked_qparams(
    qparams: tuple[np.ndarray, np.ndarray], num_channels: int, config: QuantConfig
) -> tuple[np.ndarray, np.ndarray]:
    scale = np.ascontiguousarray(qparams[0], dtype=np.float32).reshape(-1)
    zero_point = np.ascontiguousarray(qparams[1], dtype=np.int32).reshape(-1)
    for name, values in (("scale", scale), ("zero_point", zero_point)):
        if values.size != num_channels:
            raise ValueError(f"qparams {name} has {values.size} entries; expected {num_channels} (one per channel)")
    if not (np.isfinite(scale) & (scale > 0)).all():
        raise ValueError(f"qparams scale={scale[~(np.isfinite(scale) & (scale > 0))][:1]} ...; expected finite, > 0")
    if ((zero_point < 0) | (zero_point > config.qmax)).any():
        raise ValueError(f"qparams zero_point outside 0..{config.qmax}")
    return scale, zero_point


def decode(q: QuantizedArray, out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize to a new (or the given) flat float32 array.

    Args:
        q: the encoded array.
        out: optional float32 array of ``q.numel`` elements to write into.

    Returns:
        The float32 values on the grid, ``q.numel`` of them.
    """
    if out is None:
        out = np.empty(q.numel, np.float32)
    _dequantize(q, out, accumulate=False)
    return out


def decode_accumulate(q: QuantizedArray, out: np.ndarray, *, divide_by: int = 1) -> None:
    """Add the dequantized values of ``q`` into ``out`` in place (the aggregator's hot path).

    Args:
        q: the encoded array.
        out: contiguous float32 accumulator of ``q.numel`` elements.
        divide_by: then divide by this in the same pass: ``out = (out + x) / divide_by``,
            the same float32 arithmetic as adding and dividing apart (the last
            contribution turns the sum into the mean without another pass).

    Raises:
        ValueError: if ``out`` is not a contiguous float32 array of ``q.numel`` elements.
    """
    _dequantize(q, out, accumulate=True, divide_by=divide_by)


def _dequantize(q: QuantizedArray, out: np.ndarray, accumulate: bool, divide_by: int = 1) -> None:
    if out.dtype != np.float32 or out.size != q.numel or not out.flags.c_contiguous:
        raise ValueError(
            f"out has dtype={out.dtype}, size={out.size}, contiguous={out.flags.c_contiguous}; "
            f"expected a contiguous float32 array of {q.numel} elements"
        )
    flat_out = out.reshape(-1)
    if not q.scheme.is_quantized:
        values = q.payload.view(np.float16 if q.scheme is Scheme.FLOAT16 else np.float32)
        if accumulate:
            flat_out += values
        else:
            flat_out[:] = values
        if divide_by != 1:
            flat_out /= np.float32(divide_by)
        return
    if q.numel == 0:
        return
    divisor = np.float32(divide_by)
    _kernels().dequantize_into(q.payload, q.bits, q.channel_size, q.scale, q.zero_point, flat_out, accumulate, divisor)


def fake_quantize(x: np.ndarray, config: QuantConfig, *, rng: np.random.Generator | None = None) -> np.ndarray:
    """Round trip ``x`` through the wire grid: ``decode(encode(x, config))``, shaped like ``x``.

    Args:
        x: a float array.
        config: the scheme to simulate.
        rng: generator for stochastic rounding.

    Returns:
        float32 array of ``x``'s shape holding exactly what a receiver would decode.
    """
    return decode(encode(x, config, rng=rng)).reshape(np.shape(x))


def wire_size(numel: int, config: QuantConfig) -> int:
    """Bytes an encoded array of ``numel`` elements occupies on the wire, metadata included.

    Args:
        numel: element count.
        config: the scheme.

    Returns:
        Payload plus per-channel scale (4 bytes) and zero point (4 bytes) plus
        ``METADATA_BYTES``; equals ``encode(x, config).nbytes``.
    """
    if numel < 0:
        raise ValueError(f"numel={numel} is negative; expected >= 0")
    if not config.scheme.is_quantized:
        return METADATA_BYTES + numel * (2 if config.scheme is Scheme.FLOAT16 else 4)
    payload = math.ceil(numel * config.bits / 8)
    return METADATA_BYTES + payload + 8 * _num_channels(numel, config)
