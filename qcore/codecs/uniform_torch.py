"""Torch twin of ``uniform``: the same grids in torch ops, byte-identical, on any device.

It mirrors ``gradq.qcore._kernels`` step for step: qparams in float64 from
float32 ranges, float32 division, round-half-to-even (or the same counter-based
noise for stochastic rounding), LSB-first packing.
"""

from __future__ import annotations

import numpy as np
import torch

from gradq.qcore.codecs.base import DeviceEncoding, noise_key
from gradq.qcore.codecs.uniform import UniformCodec
from gradq.qcore.packing import packed_size
from gradq.qcore.quantized import LARGEST_QUANTIZABLE
from gradq.qcore.scheme import QuantConfig
from gradq.qcore.torch_codec import refuse_out_of_range

__all__ = ["UniformTorchTwin", "twin"]

_SMALLEST_SCALE = float(np.finfo(np.float32).smallest_subnormal)


def _signed(constant: int) -> int:
    # torch has no uint64 arithmetic; int64 wraps on the same bits.
    return constant - (1 << 64) if constant >= 1 << 63 else constant


# splitmix64, as _kernels._uniform draws it.
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical (unsigned) right shift of int64 words: torch's ``>>`` is arithmetic."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(key: int, count: int, device: torch.device) -> torch.Tensor:
    """float32 in [0, 1) for indices 0..count-1: _kernels._uniform's values exactly."""
    z = torch.arange(count, dtype=torch.int64, device=device) * _GOLDEN + key
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """LSB-first packing of uint8 levels: each group of 8 levels becomes ``bits`` bytes."""
    numel = levels.numel()
    if bits == 8:
        return levels
    groups = -(-numel // 8)
    padded = torch.zeros(groups * 8, dtype=torch.int64, device=levels.device)
    padded[:numel] = levels
    shifts = torch.arange(8, device=levels.device, dtype=torch.int64) * bits
    words = (padded.view(groups, 8) << shifts).sum(dim=1)  # <= 56 bits: fits int64
    byte_shifts = torch.arange(bits, device=levels.device, dtype=torch.int64) * 8
    packed = ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return packed[: packed_size(numel, bits)]


def unpack(payload: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack``: ``numel`` uint8 levels."""
    if bits == 8:
        return payload[:numel]
    groups = -(-numel // 8)
    padded = torch.zeros(groups * bits, dtype=torch.int64, device=payload.device)
    padded[: payload.numel()] = payload
    byte_shifts = torch.arange(bits, device=payload.device, dtype=torch.int64) * 8
    words = (padded.view(groups, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=payload.device, dtype=torch.int64) * bits
    levels = (words[:, None] >> shifts) & ((1 << bits) - 1)
    return levels.to(torch.uint8).reshape(-1)[:numel]


class UniformTorchTwin:
    """Encode and decode a UniformCodec's grid on the tensors' device."""

    def __init__(self, codec: UniformCodec) -> None:
        self.codec = codec

    def _qparams(
        self, lo: torch.Tensor, hi: torch.Tensor, qmax: int, stochastic: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """_kernels.qparams_from_range over channels: (scale float32, zero_point float32, integral)."""
        mid = (qmax + 1) // 2
        lo64, hi64 = lo.double(), hi.double()
        low, high = lo64.clamp(max=0.0), hi64.clamp(min=0.0)
        # Constant channels divide 0 by 0 here; torch.where below replaces them.
        if self.codec.symmetric:
            scale = torch.maximum(-low, high) / ((qmax - mid) if stochastic else (qmax / 2.0))
            zero_point = torch.full_like(lo64, mid)
        elif stochastic and qmax > 1:
            scale = (high - low) / (qmax - 1)
            zero_point = torch.ceil(-low / scale).clamp(max=qmax)
        else:
            scale = (high - low) / qmax
            zero_point = torch.round(-low / scale).clamp(0, qmax)
        constant = lo64 == hi64
        constant_zero_point = torch.full_like(lo64, mid) if self.codec.symmetric else (lo64 < 0).double()
        scale = torch.where(constant, torch.where(lo64 == 0, torch.ones_like(lo64), lo64.abs()), scale)
        zero_point = torch.where(constant, constant_zero_point, zero_point)
        return scale.clamp(min=_SMALLEST_SCALE).float(), zero_point.float()

    def encode(self, flat: torch.Tensor, config: QuantConfig, rng: np.random.Generator | None) -> DeviceEncoding:
        """Quantize a flat float32 tensor (see ``UniformCodec.encode``)."""
        key = noise_key(config, rng)
        numel = flat.numel()
        channel_size = self.codec.wire_channel_size(numel, config.channel_size)
        channels = self.codec.num_channels(numel, channel_size)
        if numel == 0:
            zeros = torch.zeros(channels, dtype=torch.float32, device=flat.device)
            scale, zero_point = self._qparams(zeros, zeros, config.qmax, False)
            empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
            return DeviceEncoding(config.bits, channel_size, scale, zero_point.to(torch.int32), empty)
        # Pad with the last value, which leaves the last channel's min and max unchanged.
        padding = flat[-1:].expand(channels * channel_size - numel)
        padded = torch.cat([flat, padding]).view(channels, channel_size)
        lo, hi = padded.amin(dim=1), padded.amax(dim=1)
        if not bool((torch.maximum(lo.abs(), hi.abs()) < LARGEST_QUANTIZABLE).all()):  # NaN compares False too
            refuse_out_of_range(flat, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126")
        scale, zero_point = self._qparams(lo, hi, config.qmax, key >= 0)
        scaled = padded / scale[:, None]
        if key < 0:
            rounded = torch.round(scaled)
        else:
            rounded = torch.floor(scaled + uniform_noise(key, channels * channel_size, flat.device).view_as(scaled))
        levels = (rounded + zero_point[:, None]).clamp(0, config.qmax).to(torch.uint8).reshape(-1)[:numel]
        return DeviceEncoding(config.bits, channel_size, scale, zero_point.to(torch.int32), pack(levels, config.bits))

    def decode(self, encoding: DeviceEncoding, numel: int, out: torch.Tensor) -> None:
        """``out = scale_c * (level - zero_point_c)``, in float32 as _kernels.dequantize_into."""
        if numel == 0:
            return
        channels, channel_size = encoding.scale.numel(), encoding.channel_size
        levels = torch.zeros(channels * channel_size, dtype=torch.float32, device=out.device)
        levels[:numel] = unpack(encoding.payload, encoding.bits, numel)
        zero_point = encoding.zero_point.to(torch.float32)
        values = encoding.scale[:, None] * (levels.view(channels, channel_size) - zero_point[:, None])
        out.copy_(values.reshape(-1)[:numel])


def twin(codec: UniformCodec) -> UniformTorchTwin:
    """The torch twin of ``codec`` (the registry calls this on first use)."""
    return UniformTorchTwin(codec)
