"""Uniform integer grids, per tensor or per channel, affine or symmetric: 1..8-bit levels plus qparams.

One kernel layer (``gradq.qcore._kernels``) serves the four schemes; they differ
in whether each channel of ``channel_size`` elements has its own qparams and
whether the zero point is fixed at mid-range.
"""

from __future__ import annotations

import numpy as np

from gradq.qcore.codecs.base import Codec, noise_key
from gradq.qcore.packing import channel_count, packed_size
from gradq.qcore.quantized import LARGEST_QUANTIZABLE, QuantizedArray, refuse_out_of_range
from gradq.qcore.scheme import DEFAULT_CHANNEL_SIZE, QuantConfig, Scheme

__all__ = ["CODECS", "UniformCodec"]


def _kernels():  # type: ignore[no-untyped-def]
    # numba costs ~0.5 s to import; pay it on the first encode, not on import.
    from gradq.qcore import _kernels

    return _kernels


class UniformCodec(Codec):
    """``scale * (level - zero_point)`` on a ``2**bits``-level grid.

    Args:
        scheme: the wire enum value.
        per_channel: every ``channel_size`` run has its own qparams (else one pair).
        symmetric: the zero point is the grid's mid-point, so the grid is centred on 0.
    """

    quantized = True

    def __init__(self, scheme: Scheme, *, per_channel: bool, symmetric: bool) -> None:
        super().__init__(scheme, "gradq.qcore.codecs.uniform_torch")
        self.per_channel = per_channel
        self.symmetric = symmetric
        # A symmetric grid needs a level below, at and above zero.
        self.lowest_bits = 2 if symmetric else 1

    def wire_bits(self, config: QuantConfig) -> int:
        """Bits per level: the config's."""
        return config.bits

    def wire_channel_size(self, numel: int, channel_size: int) -> int:
        """``channel_size`` per channel; the whole array (at least 1) per tensor."""
        return channel_size if self.per_channel else max(numel, 1)

    def num_channels(self, numel: int, channel_size: int) -> int:
        """``ceil(numel / channel_size)`` per channel; 1 per tensor."""
        return channel_count(numel, channel_size) if self.per_channel else 1

    def check_config(self, config: QuantConfig) -> None:
        """Refuse 1 bit on a symmetric grid."""
        if config.bits < self.lowest_bits:
            raise ValueError(
                f"bits={config.bits} with scheme={self.name}: a symmetric grid needs bits >= 2 to hold "
                "both signs and zero; use an affine scheme for 1 bit"
            )

    def grid_channel_size(self, channel_size: int) -> int:
        """Per-channel grids: their channel size; per-tensor ones: 0."""
        return channel_size if self.per_channel else 0

    def mean_config(self, bits: int, channel_size: int, topk: int = 0) -> QuantConfig:
        """The pushers' own grid: same scheme and bits (and channel size, per channel)."""
        return QuantConfig(self.scheme, bits, channel_size if self.per_channel else DEFAULT_CHANNEL_SIZE)

    def encode(
        self,
        flat: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        qparams: tuple[np.ndarray, np.ndarray] | None,
        dtype: str,
    ) -> QuantizedArray:
        """Observe, derive qparams (unless given) and quantize each channel in one fused pass."""
        numel = flat.size
        channel_size = self.wire_channel_size(numel, config.channel_size)
        num_channels = self.num_channels(numel, channel_size)
        kernels = _kernels()
        levels = np.empty(numel, np.uint8)
        key = noise_key(config, rng)
        if qparams is None:
            scale = np.empty(num_channels, np.float32)
            zero_point = np.empty(num_channels, np.int32)
            if numel == 0:
                scale[:], zero_point[:] = kernels.qparams_from_range(0.0, 0.0, config.qmax, self.symmetric, False)
                bad = -1
            else:
                bad = kernels.quantize_fused(
                    flat, channel_size, config.qmax, self.symmetric, key, levels, scale, zero_point
                )
        else:
            scale, zero_point = _checked_qparams(qparams, num_channels, config)
            bad = kernels.quantize_with_qparams(flat, channel_size, config.qmax, key, scale, zero_point, levels)
        return self._packed(flat, bad, channel_size, levels, scale, zero_point, config, dtype)

    def encode_compensated(
        self,
        flat: np.ndarray,
        residual: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        dtype: str,
    ) -> QuantizedArray:
        """Compensate, observe, quantize and update the residual of each channel in one fused pass."""
        numel = flat.size
        if numel == 0:
            return self.encode(flat, config, rng, None, dtype)
        channel_size = self.wire_channel_size(numel, config.channel_size)
        num_channels = self.num_channels(numel, channel_size)
        levels = np.empty(numel, np.uint8)
        scale = np.empty(num_channels, np.float32)
        zero_point = np.empty(num_channels, np.int32)
        bad = _kernels().quantize_compensated(
            flat, residual, channel_size, config.qmax, self.symmetric, noise_key(config, rng), levels, scale, zero_point
        )
        # The failing channel's compensated values are in ``residual``: the message names them.
        return self._packed(residual, bad, channel_size, levels, scale, zero_point, config, dtype)

    def _packed(
        self,
        values: np.ndarray,
        bad: int,
        channel_size: int,
        levels: np.ndarray,
        scale: np.ndarray,
        zero_point: np.ndarray,
        config: QuantConfig,
        dtype: str,
    ) -> QuantizedArray:
        """Refuse the kernel's failing channel ``bad`` (if >= 0), else pack the levels."""
        if bad >= 0:
            start = bad * channel_size
            window = values[start : start + channel_size]
            refuse_out_of_range(window, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126", start)
        if config.bits == 8:
            payload = levels
        else:
            payload = np.empty(packed_size(values.size, config.bits), np.uint8)
            _kernels().pack(levels, config.bits, payload)
        return QuantizedArray(self.scheme, config.bits, values.size, channel_size, scale, zero_point, payload, dtype)

    def dequantize(self, q: QuantizedArray, out: np.ndarray, accumulate: bool, divisor: int) -> None:
        """Unpack and dequantize (accumulate, divide) in the fused kernel."""
        if q.numel == 0:
            return
        _kernels().dequantize_into(
            q.payload, q.bits, q.channel_size, q.scale, q.zero_point, out, accumulate, np.float32(divisor)
        )

    def squared_error(self, q: QuantizedArray, reference: np.ndarray) -> tuple[float, float]:
        """Both sums in one pass over the payload and ``reference``, writing no array (``dequantize_error``)."""
        if q.numel == 0:
            return 0.0, 0.0
        error, norm = _kernels().dequantize_error(q.payload, q.bits, q.channel_size, q.scale, q.zero_point, reference)
        return float(error), float(norm)

    def _check_header(self, field: str, bits: int, numel: int, channel_size: int) -> None:
        if not self.lowest_bits <= bits <= 8:
            raise ValueError(f"{field}.bits={bits} is invalid for {self.scheme.name}; expected {self.lowest_bits}..8")
        if not self.per_channel:
            self._check_whole_tensor(field, numel, channel_size)
        elif channel_size < 1:
            raise ValueError(f"{field}.channel_size={channel_size} is invalid; expected >= 1 for {self.scheme.name}")

    def _check_values(self, field: str, bits: int, zero_point: np.ndarray, payload: np.ndarray) -> None:
        qmax = (1 << bits) - 1
        mid = (qmax + 1) // 2
        if not zero_point.size:
            return
        # Two reductions on the aggregator's path; the elementwise test only runs to name the first bad one.
        low, high = (mid, mid) if self.symmetric else (0, qmax)
        if zero_point.min() >= low and zero_point.max() <= high:
            return
        off_grid = zero_point != mid if self.symmetric else (zero_point < 0) | (zero_point > qmax)
        if off_grid.any():
            index = int(np.flatnonzero(off_grid)[0])
            expected = f"{mid} (symmetric mid-point)" if self.symmetric else f"0..{qmax}"
            raise ValueError(
                f"{field}.zero_point[{index}]={int(zero_point[index])} is off the grid; expected {expected}"
            )


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


CODECS = (
    UniformCodec(Scheme.PER_TENSOR_AFFINE, per_channel=False, symmetric=False),
    UniformCodec(Scheme.PER_TENSOR_SYMMETRIC, per_channel=False, symmetric=True),
    UniformCodec(Scheme.PER_CHANNEL_AFFINE, per_channel=True, symmetric=False),
    UniformCodec(Scheme.PER_CHANNEL_SYMMETRIC, per_channel=True, symmetric=True),
)
