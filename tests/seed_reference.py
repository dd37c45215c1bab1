"""Seed 000's uint8 affine quantization (per tensor and per channel) transcribed to plain numpy, without gradq."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QMIN = 0
QMAX = 255
SEED_CHANNEL_SIZE = 512


@dataclass(frozen=True)
class SeedEncoding:
    """What the seed's hook sends: uint8 levels (padded, per channel) and one scale/zero point per channel."""

    levels: np.ndarray  # uint8, flat; per channel it still holds the seed's zero padding
    scale: np.ndarray  # float32, one per channel
    zero_point: np.ndarray  # int64, one per channel


def calculate_qparams(min_val: float, max_val: float) -> tuple[float, int]:
    """The seed's ``_MinMaxObserver.calculate_qparams``: Python floats, half-to-even ``round``."""
    if max_val == min_val:
        return 1.0, QMIN
    scale = (max_val - min_val) / float(QMAX - QMIN)
    zero_point = round(QMIN - min_val / scale)  # the seed wraps this in int(); round() of a float is already one
    return scale, max(QMIN, min(QMAX, zero_point))


def quantize(x: np.ndarray, scale: np.float32, zero_point: int) -> np.ndarray:
    """``clamp(round(x / scale) + zero_point, 0, 255)`` in float32, as torch computes it on a float32 tensor."""
    y = np.rint(np.asarray(x, np.float32) / np.float32(scale)) + np.float32(zero_point)
    return np.clip(y, np.float32(QMIN), np.float32(QMAX)).astype(np.uint8)


def dequantize(levels: np.ndarray, scale: np.float32, zero_point: int) -> np.ndarray:
    """``scale * (level - zero_point)`` in float32."""
    return np.float32(scale) * (levels.astype(np.float32) - np.float32(zero_point))


def quantize_per_tensor(x: np.ndarray) -> SeedEncoding:
    """``quantization_pertensor_hook`` for one rank: observe, derive qparams, quantize."""
    flat = np.asarray(x, np.float32).reshape(-1)
    scale, zero_point = calculate_qparams(float(flat.min()), float(flat.max()))
    # The hook ships (scale, zero_point) in a float32 tensor, so the scale it uses is float32.
    scale32 = np.float32(scale)
    return SeedEncoding(
        quantize(flat, scale32, zero_point),
        np.array([scale32], np.float32),
        np.array([zero_point], np.int64),
    )


def quantize_per_channel(x: np.ndarray, channel_size: int = SEED_CHANNEL_SIZE) -> SeedEncoding:
    """``quantization_perchannel_hook`` for one rank, padding included.

    The seed pads ``channel_size - len % channel_size`` zeros, which is a whole
    extra channel of zeros when the length is already a multiple; this keeps
    that, so callers compare only the first ``ceil(n / channel_size)`` channels.
    """
    flat = np.asarray(x, np.float32).reshape(-1)
    padding = channel_size - flat.size % channel_size
    channels = np.concatenate([flat, np.zeros(padding, np.float32)]).reshape(-1, channel_size)
    qparams = [calculate_qparams(float(row.min()), float(row.max())) for row in channels]
    scales = np.array([scale for scale, _ in qparams], np.float32)
    zero_points = np.array([zero_point for _, zero_point in qparams], np.int64)
    levels = np.concatenate(
        [quantize(row, scale, int(zp)) for row, scale, zp in zip(channels, scales, zero_points, strict=True)]
    )
    return SeedEncoding(levels, scales, zero_points)


def dequantize_encoding(encoding: SeedEncoding, channel_size: int) -> np.ndarray:
    """Dequantize every channel of ``encoding`` (padding included) to a flat float32 array."""
    channels = encoding.levels.reshape(-1, channel_size)
    return np.concatenate(
        [
            dequantize(row, scale, int(zp))
            for row, scale, zp in zip(channels, encoding.scale, encoding.zero_point, strict=True)
        ]
    )
