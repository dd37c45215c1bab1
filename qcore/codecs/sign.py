"""Scaled sign per channel: one bit per element, each channel's mean magnitude as its scale.

Element i decodes to ``+scale_c`` or ``-scale_c`` (``scale_c`` the mean of
``|x|`` over its channel), the 1-bit compressor of error-feedback signSGD
(Karimireddy et al., 2019). The affine grid at 1 bit keeps 0.0 as a level, so
each channel holds 0 and one signed step: every value of the other sign is
sent as 0, and with error feedback the digits and transformer runs of
bench/convergence.py stayed 11% to 27% off fp32's loss. A scaled sign sends
both signs of every channel, and its error ``|x| - scale`` never exceeds ``|x|``
in sum of squares, which is what error feedback needs to converge.

The mean is summed exactly (in integers, at 2**-30 of the channel's largest
magnitude), so the torch twin, whatever its reduction order, reproduces the
numpy scale bit for bit.
"""

from __future__ import annotations

import numpy as np

from gradq.qcore.codecs.base import Codec
from gradq.qcore.packing import channel_count, packed_size
from gradq.qcore.quantized import LARGEST_QUANTIZABLE, QuantizedArray, refuse_out_of_range
from gradq.qcore.scheme import QuantConfig, Scheme

__all__ = ["CODECS", "SignCodec", "FIXED_POINT_BITS", "SMALLEST_SCALE"]

# |x| is summed as integers of this many bits below the channel's largest power of two.
FIXED_POINT_BITS = 30
# An all-zero channel decodes to +-this, the smallest positive float32 (a scale must be > 0 on the wire).
SMALLEST_SCALE = float(np.finfo(np.float32).smallest_subnormal)
# A sign has no zero point: every encoding carries this empty array, and the wire none.
_NO_ZERO_POINTS = np.empty(0, np.int32)
_NO_ZERO_POINTS.flags.writeable = False


def _kernels():  # type: ignore[no-untyped-def]
    # numba costs ~0.5 s to import; pay it on the first encode, not on import.
    from gradq.qcore.codecs import _sign_kernels

    return _sign_kernels


class SignCodec(Codec):
    """``scale_c * (2 * bit - 1)``: one bit per element, one scale per channel (``config.bits`` is ignored)."""

    quantized = True
    zero_points = False

    def __init__(self, scheme: Scheme) -> None:
        super().__init__(scheme, "gradq.qcore.codecs.sign_torch")

    def wire_bits(self, config: QuantConfig) -> int:
        """Always 1."""
        return 1

    def wire_channel_size(self, numel: int, channel_size: int) -> int:
        """The config's channel size."""
        return channel_size

    def num_channels(self, numel: int, channel_size: int) -> int:
        """``ceil(numel / channel_size)``."""
        return channel_count(numel, channel_size)

    def check_config(self, config: QuantConfig) -> None:
        """Any bits (ignored) and channel size."""

    def grid_channel_size(self, channel_size: int) -> int:
        """Its channel size."""
        return channel_size

    def mean_config(self, bits: int, channel_size: int, topk: int = 0) -> QuantConfig:
        """The same scaled-sign grid (the mean loses its magnitudes; ``--server-error-feedback true`` carries them)."""
        return QuantConfig(self.scheme, 1, channel_size)

    def encode(
        self,
        flat: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        qparams: tuple[np.ndarray, np.ndarray] | None,
        dtype: str,
    ) -> QuantizedArray:
        """One sign bit per element (``x >= 0`` is 1) and each channel's exact mean ``|x|``."""
        if qparams is not None:
            raise ValueError(f"qparams are not used by scheme={self.name}; its scale is each channel's mean |x|")
        numel, channel_size = flat.size, config.channel_size
        scale = np.empty(self.num_channels(numel, channel_size), np.float32)
        signs = np.empty(numel, np.uint8)
        bad = _kernels().encode_signs(flat, channel_size, scale, signs)
        return self._packed(flat, bad, channel_size, scale, signs, dtype)

    def encode_compensated(
        self,
        flat: np.ndarray,
        residual: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        dtype: str,
    ) -> QuantizedArray:
        """Compensate, encode and update the residual of each channel in one fused pass."""
        numel, channel_size = flat.size, config.channel_size
        scale = np.empty(self.num_channels(numel, channel_size), np.float32)
        signs = np.empty(numel, np.uint8)
        bad = _kernels().encode_signs_compensated(flat, residual, channel_size, scale, signs)
        # The failing channel's compensated values are in ``residual``: the message names them.
        return self._packed(residual, bad, channel_size, scale, signs, dtype)

    def _packed(
        self, values: np.ndarray, bad: int, channel_size: int, scale: np.ndarray, signs: np.ndarray, dtype: str
    ) -> QuantizedArray:
        """Refuse the kernel's failing channel ``bad`` (if >= 0), else pack the sign bits."""
        if bad >= 0:
            start = bad * channel_size
            window = values[start : start + channel_size]
            refuse_out_of_range(window, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126", start)
        payload = np.empty(packed_size(values.size, 1), np.uint8)
        _kernels().pack(signs, 1, payload)
        return QuantizedArray(self.scheme, 1, values.size, channel_size, scale, _NO_ZERO_POINTS, payload, dtype)

    def dequantize(self, q: QuantizedArray, out: np.ndarray, accumulate: bool, divisor: int) -> None:
        """``out (+)= scale_c * (+-1)``, then divide, in float32 as the uniform kernel does."""
        if q.numel == 0:
            return
        _kernels().decode_signs(q.payload, q.channel_size, q.scale, out, accumulate, np.float32(divisor))

    def _check_header(self, field: str, bits: int, numel: int, channel_size: int) -> None:
        if bits != 1:
            raise ValueError(f"{field}.bits={bits} is invalid for {self.scheme.name}; expected 1")
        if channel_size < 1:
            raise ValueError(f"{field}.channel_size={channel_size} is invalid; expected >= 1 for {self.scheme.name}")

    def _check_values(self, field: str, bits: int, zero_point: np.ndarray, payload: np.ndarray) -> None:
        """Nothing to refuse: any bit is a sign, and there are no zero points (``from_wire`` checked their size)."""


CODECS = (SignCodec(Scheme.PER_CHANNEL_SIGN),)
