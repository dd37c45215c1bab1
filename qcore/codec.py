"""Encode a flat float array onto the wire grid and decode it back (numpy), through the codec registry."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from gradq.qcore.codecs import codec_for
from gradq.qcore.quantized import LARGEST_QUANTIZABLE, METADATA_BYTES, QuantizedArray
from gradq.qcore.scheme import QuantConfig

__all__ = [
    "LARGEST_QUANTIZABLE",
    "METADATA_BYTES",
    "QuantizedArray",
    "encode",
    "decode",
    "decode_accumulate",
    "decode_times",
    "fake_quantize",
    "relative_error",
    "wire_size",
]


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
    flat = np.ascontiguousarray(np.asarray(x).reshape(-1), dtype=np.float32)
    return codec_for(config.scheme).encode(flat, config, rng, qparams, dtype)


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


def decode_times(q: QuantizedArray, out: np.ndarray, factor: float, *, accumulate: bool, divide_by: int = 1) -> None:
    """``out (+)= factor * decode(q)``, then divide by ``divide_by``: a contribution to a weighted mean.

    On a scaled grid the factor folds into the per-channel scales (a copy of
    ``num_channels`` floats; the sparse scheme's lookup), so the pass over the payload is the unweighted
    decode's; the float pass-through schemes, which carry no scale, decode
    into a temporary array and multiply it.

    Raises:
        ValueError: ``out`` is not a contiguous float32 array of ``q.numel`` elements, or ``factor`` is not a
            finite number > 0.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor={factor!r} is invalid; expected a finite number > 0")
    if factor == 1.0:
        _dequantize(q, out, accumulate, divide_by)
        return
    if q.scale.size:
        _dequantize(replace(q, scale=q.scale * np.float32(factor)), out, accumulate, divide_by)
        return
    _check_out("out", out, q.numel)
    values = decode(q)
    np.multiply(values, np.float32(factor), out=values)
    flat = out.reshape(-1)
    if accumulate:
        np.add(flat, values, out=flat)
    else:
        flat[:] = values
    if divide_by != 1:
        np.divide(flat, np.float32(divide_by), out=flat)


def relative_error(q: QuantizedArray, reference: np.ndarray) -> float:
    """``||decode(q) - reference|| / ||reference||``: what encoding ``reference`` as ``q`` lost (0 when it is zero).

    The aggregator reports it for every round's mean (a metric). The uniform
    grids compute it in one pass over the payload and ``reference``, without
    decoding into an array (a 2^20-element mean: about a third of the CPU of
    decoding, subtracting and taking two norms).

    Raises:
        ValueError: if ``reference`` is not a contiguous float32 array of ``q.numel`` elements.
    """
    _check_out("reference", reference, q.numel)
    error, norm = codec_for(q.scheme).squared_error(q, reference.reshape(-1))
    return math.sqrt(error / norm) if norm > 0 else 0.0


def _dequantize(q: QuantizedArray, out: np.ndarray, accumulate: bool, divide_by: int = 1) -> None:
    _check_out("out", out, q.numel)
    codec_for(q.scheme).dequantize(q, out.reshape(-1), accumulate, divide_by)


def _check_out(name: str, array: np.ndarray, numel: int) -> None:
    if array.dtype != np.float32 or array.size != numel or not array.flags.c_contiguous:
        raise ValueError(
            f"{name} has dtype={array.dtype}, size={array.size}, contiguous={array.flags.c_contiguous}; "
            f"expected a contiguous float32 array of {numel} elements"
        )


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
    return codec_for(config.scheme).wire_size(numel, config)
