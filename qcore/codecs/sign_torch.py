"""Torch twin of ``sign``: the same bits and the same exact channel means, on any device."""

from __future__ import annotations

import numpy as np
import torch

from gradq.qcore.codecs.base import DeviceEncoding
from gradq.qcore.codecs.sign import FIXED_POINT_BITS, SMALLEST_SCALE, SignCodec
from gradq.qcore.codecs.uniform_torch import pack, unpack
from gradq.qcore.quantized import LARGEST_QUANTIZABLE
from gradq.qcore.scheme import QuantConfig
from gradq.qcore.torch_codec import refuse_out_of_range

__all__ = ["SignTorchTwin", "twin"]


class SignTorchTwin:
    """Encode and decode a SignCodec's scaled signs on the tensors' device."""

    def __init__(self, codec: SignCodec) -> None:
        self.codec = codec

    def encode(self, flat: torch.Tensor, config: QuantConfig, rng: np.random.Generator | None) -> DeviceEncoding:
        """Sign bits and each channel's exact mean ``|x|`` (see ``SignCodec.encode``)."""
        if not bool((flat.abs() < LARGEST_QUANTIZABLE).all()):  # NaN compares False too
            refuse_out_of_range(flat, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126")
        numel, channel_size = flat.numel(), config.channel_size
        channels = self.codec.num_channels(numel, channel_size)
        magnitude = torch.zeros(channels * channel_size, dtype=torch.float32, device=flat.device)
        magnitude[:numel] = flat.abs()
        rows = magnitude.view(channels, channel_size)
        lengths = torch.full((channels,), float(channel_size), dtype=torch.float64, device=flat.device)
        if numel % channel_size:
            lengths[-1] = numel % channel_size
        largest = rows.amax(dim=1) if channels else torch.zeros(0, device=flat.device)
        _, exponent = torch.frexp(largest)
        unit = torch.ldexp(torch.ones(channels, dtype=torch.float64, device=flat.device), exponent - FIXED_POINT_BITS)
        counts = torch.floor(rows.double() / unit[:, None]).to(torch.int64).sum(dim=1)
        scale = (counts.double() * unit / lengths).float().clamp(min=SMALLEST_SCALE)
        no_zero_points = torch.zeros(0, dtype=torch.int32, device=flat.device)
        return DeviceEncoding(1, channel_size, scale, no_zero_points, pack((flat >= 0).to(torch.uint8), 1))

    def decode(self, encoding: DeviceEncoding, numel: int, out: torch.Tensor) -> None:
        """``out = scale_c * (+-1)`` in float32."""
        if numel == 0:
            return
        signs = unpack(encoding.payload, 1, numel).to(torch.float32) * 2 - 1
        out.copy_(signs * encoding.scale.repeat_interleave(encoding.channel_size)[:numel])


def twin(codec: SignCodec) -> SignTorchTwin:
    """The torch twin of ``codec`` (the registry calls this on first use)."""
    return SignTorchTwin(codec)
