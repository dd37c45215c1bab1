"""Float pass-throughs: the values themselves as float32 or float16, no qparams."""

from __future__ import annotations

import numpy as np

from gradq.qcore.codecs.base import Codec
from gradq.qcore.quantized import QuantizedArray, refuse_out_of_range
from gradq.qcore.scheme import DEFAULT_CHANNEL_SIZE, QuantConfig, Scheme

__all__ = ["CODECS", "FloatCodec"]

_FLOAT16_MAX = float(np.finfo(np.float16).max)


class FloatCodec(Codec):
    """Casts to ``wire_type`` and back; refuses what would not arrive finite.

    Args:
        scheme: the wire enum value.
        wire_type: the element type on the wire.
        limit: the exclusive bound on ``|x|``: values at or past it, and NaN, are refused.
        expected: how the refusal message states the bound.
    """

    quantized = False

    def __init__(self, scheme: Scheme, wire_type: type[np.floating], limit: float, expected: str) -> None:
        super().__init__(scheme, "gradq.qcore.codecs.floating_torch")
        self.wire_type = np.dtype(wire_type)
        self.limit = limit
        self.expected = expected

    def wire_bits(self, config: QuantConfig) -> int:
        """The wire type's width (``config.bits`` is ignored)."""
        return 8 * self.wire_type.itemsize

    def wire_channel_size(self, numel: int, channel_size: int) -> int:
        """The whole array."""
        return numel

    def num_channels(self, numel: int, channel_size: int) -> int:
        """None: floats carry no qparams."""
        return 0

    def check_config(self, config: QuantConfig) -> None:
        """Every valid QuantConfig is fine: bits and channel size are ignored."""

    def mean_config(self, bits: int, channel_size: int, topk: int = 0) -> QuantConfig:
        """The same float type."""
        return QuantConfig(self.scheme, 8, DEFAULT_CHANNEL_SIZE)

    def encode(
        self,
        flat: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        qparams: tuple[np.ndarray, np.ndarray] | None,
        dtype: str,
    ) -> QuantizedArray:
        """Cast (rounding to nearest); ``rng`` and ``qparams`` are not used."""
        refuse_out_of_range(flat, self.limit, self.expected)
        payload = flat.astype(self.wire_type).view(np.uint8)
        no_scale, no_zero_point = np.empty(0, np.float32), np.empty(0, np.int32)
        bits = self.wire_bits(config)
        return QuantizedArray(self.scheme, bits, flat.size, flat.size, no_scale, no_zero_point, payload, dtype)

    def dequantize(self, q: QuantizedArray, out: np.ndarray, accumulate: bool, divisor: int) -> None:
        """Cast back (and add, and divide)."""
        values = q.payload.view(self.wire_type)
        if accumulate:
            out += values
        else:
            out[:] = values
        if divisor != 1:
            out /= np.float32(divisor)

    def _check_header(self, field: str, bits: int, numel: int, channel_size: int) -> None:
        expected = 8 * self.wire_type.itemsize
        if bits != expected:
            raise ValueError(f"{field}.bits={bits} is invalid for {self.scheme.name}; expected {expected}")
        self._check_whole_tensor(field, numel, channel_size)

    def _check_values(self, field: str, bits: int, zero_point: np.ndarray, payload: np.ndarray) -> None:
        values = payload.view(self.wire_type)
        if not np.isfinite(values).all():
            index = int(np.flatnonzero(~np.isfinite(values))[0])
            raise ValueError(f"{field}.payload[{index}]={float(values[index])} is not finite; expected finite values")


CODECS = (
    FloatCodec(Scheme.FLOAT32, np.float32, float("inf"), "finite values (no NaN or Inf)"),
    # Below 65520 a value rounds to at most float16's largest finite value; from 65520 on, to Inf.
    FloatCodec(Scheme.FLOAT16, np.float16, _FLOAT16_MAX + 16.0, f"|x| <= {_FLOAT16_MAX:g}, float16's largest"),
)
