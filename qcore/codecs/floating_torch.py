"""Torch twin of ``floating``: the same casts on any device."""

from __future__ import annotations

import numpy as np
import torch

from gradq.qcore.codecs.base import DeviceEncoding
from gradq.qcore.codecs.floating import FloatCodec
from gradq.qcore.scheme import QuantConfig
from gradq.qcore.torch_codec import refuse_out_of_range, view_bytes

__all__ = ["FloatTorchTwin", "twin"]


class FloatTorchTwin:
    """Cast a FloatCodec's values on the tensors' device."""

    def __init__(self, codec: FloatCodec) -> None:
        self.codec = codec
        self.wire_type = getattr(torch, codec.wire_type.name)

    def encode(self, flat: torch.Tensor, config: QuantConfig, rng: np.random.Generator | None) -> DeviceEncoding:
        """Cast (rounding to nearest, as numpy does); ``rng`` is not used."""
        if not bool((flat.abs() < self.codec.limit).all()):
            refuse_out_of_range(flat, self.codec.limit, self.codec.expected)
        payload = view_bytes(flat.to(self.wire_type), torch.uint8)
        scale = torch.empty(0, dtype=torch.float32, device=flat.device)
        zero_point = torch.empty(0, dtype=torch.int32, device=flat.device)
        return DeviceEncoding(self.codec.wire_bits(config), flat.numel(), scale, zero_point, payload)

    def decode(self, encoding: DeviceEncoding, numel: int, out: torch.Tensor) -> None:
        """Cast back to float32."""
        out.copy_(view_bytes(encoding.payload, self.wire_type))


def twin(codec: FloatCodec) -> FloatTorchTwin:
    """The torch twin of ``codec`` (the registry calls this on first use)."""
    return FloatTorchTwin(codec)
