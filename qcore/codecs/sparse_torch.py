"""Torch twin of ``sparse``: the same kept entries, lookup and payload bytes, selected on the tensor's device.

The selection and the lookup run where the values live; the payload is packed
there too, so only it (about 1/146 of the float32 values at the defaults)
crosses to the host.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradq.qcore.codecs.base import DeviceEncoding
from gradq.qcore.codecs.sparse import (
    CODE_BITS,
    FIXED_POINT_BITS,
    LOOKUP_ENTRIES,
    SMALLEST_MAGNITUDE,
    SparseCodec,
    index_bits,
)
from gradq.qcore.quantized import LARGEST_QUANTIZABLE
from gradq.qcore.scheme import QuantConfig
from gradq.qcore.torch_codec import refuse_out_of_range

__all__ = ["SparseTorchTwin", "twin"]


def _pack_fixed(values: torch.Tensor, width: int) -> torch.Tensor:
    """``sparse.pack_fixed`` in torch ops: ``width`` bits per value, LSB first, zero-padded to a byte."""
    shifts = torch.arange(width, dtype=torch.int64, device=values.device)
    bits = ((values.to(torch.int64)[:, None] >> shifts) & 1).reshape(-1)
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.int64, device=values.device)
    padded[: bits.numel()] = bits
    weights = 1 << torch.arange(8, dtype=torch.int64, device=values.device)
    return (padded.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def _unpack_fixed(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of ``_pack_fixed``: ``count`` int64 values."""
    shifts = torch.arange(8, dtype=torch.int64, device=data.device)
    bits = ((data.to(torch.int64)[:, None] >> shifts) & 1).reshape(-1)[: count * width]
    weights = 1 << torch.arange(width, dtype=torch.int64, device=data.device)
    return (bits.view(count, width) * weights).sum(dim=1)


def _select(rows: torch.Tensor, keep: int) -> torch.Tensor:
    """``sparse._select``: the ``keep`` largest ``|x|`` of each row, ties to the lower index, zeros never."""
    length = rows.shape[1]
    magnitudes = rows.abs()
    if keep >= length:
        return magnitudes > 0
    # The keep-th largest is the (length - keep + 1)-th smallest: an element's exact value, as numpy's partition.
    threshold = torch.kthvalue(magnitudes, length - keep + 1, dim=1).values[:, None]
    mask = magnitudes > threshold
    ties = (magnitudes == threshold) & (threshold > 0)
    need = keep - mask.sum(dim=1, keepdim=True)
    return mask | (ties & (ties.cumsum(dim=1) <= need))


def _exact_mean(magnitudes: torch.Tensor, per_unit: float) -> float:
    """``sparse.exact_mean_magnitudes``: an integer sum of floored units, so any order gives the same float32."""
    if magnitudes.numel() == 0:
        return SMALLEST_MAGNITUDE
    count = int(torch.floor(magnitudes.double() * per_unit).to(torch.int64).sum())
    return max(float(np.float32(float(count) / per_unit / magnitudes.numel())), SMALLEST_MAGNITUDE)


class SparseTorchTwin:
    """Encode and decode a SparseCodec's kept entries on the tensors' device."""

    def __init__(self, codec: SparseCodec) -> None:
        self.codec = codec

    def encode(self, flat: torch.Tensor, config: QuantConfig, rng: np.random.Generator | None) -> DeviceEncoding:
        """The numpy encode's bytes (see ``SparseCodec.encode``)."""
        if not bool((flat.abs() < LARGEST_QUANTIZABLE).all()):  # NaN compares False too
            refuse_out_of_range(flat, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126")
        chunk, topk, numel = config.channel_size, config.topk, flat.numel()
        whole = numel // chunk
        masks = []
        if whole:
            masks.append(_select(flat[: whole * chunk].view(whole, chunk), topk).reshape(-1))
        if numel % chunk:
            masks.append(_select(flat[whole * chunk :].view(1, -1), topk).reshape(-1))
        mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool, device=flat.device)
        kept = torch.nonzero(mask).reshape(-1)
        chunks = -(-numel // chunk)
        counts = torch.bincount(kept // chunk, minlength=chunks) if chunks else kept.new_zeros(0)
        lengths = torch.full((chunks,), chunk, dtype=torch.int64, device=flat.device)
        if numel % chunk:
            lengths[-1] = numel % chunk
        full = counts == torch.clamp(lengths, max=topk)
        values = flat[kept]
        lookup, codes = self._lookup(values)
        flag_bits = torch.zeros(-(-chunks // 8) * 8, dtype=torch.int64, device=flat.device)
        flag_bits[:chunks] = full.to(torch.int64)
        weights = 1 << torch.arange(8, dtype=torch.int64, device=flat.device)
        flags = (flag_bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)
        partial = counts[~full]
        partial_bytes = torch.stack([partial & 0xFF, partial >> 8], dim=1).reshape(-1).to(torch.uint8)
        payload = torch.cat(
            [flags, partial_bytes, _pack_fixed(kept % chunk, index_bits(chunk)), _pack_fixed(codes, CODE_BITS)]
        )
        no_zero_points = torch.zeros(0, dtype=torch.int32, device=flat.device)
        return DeviceEncoding(CODE_BITS, chunk, lookup, no_zero_points, payload, topk)

    @staticmethod
    def _lookup(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``sparse.lookup_of`` on the device: the 4 exact bin means and each value's code."""
        lookup = [SMALLEST_MAGNITUDE] * LOOKUP_ENTRIES
        codes = torch.zeros(values.numel(), dtype=torch.int64, device=values.device)
        if values.numel():
            magnitudes = values.abs()
            _, exponent = math.frexp(float(magnitudes.max()))
            per_unit = math.ldexp(1.0, FIXED_POINT_BITS - exponent)
            positive = values > 0
            for sign in (0, 1):
                mine = positive == bool(sign)
                threshold = _exact_mean(magnitudes[mine], per_unit)
                high = magnitudes >= threshold
                for level in (0, 1):
                    lookup[2 * sign + level] = _exact_mean(magnitudes[mine & (high == bool(level))], per_unit)
                codes[mine] = 2 * sign + high[mine].to(torch.int64)
        return torch.tensor(lookup, dtype=torch.float32, device=values.device), codes

    def decode(self, encoding: DeviceEncoding, numel: int, out: torch.Tensor) -> None:
        """``out = decode``: zeros, and the kept entries' signed lookup magnitudes."""
        out.zero_()
        if numel == 0:
            return
        chunk, topk = encoding.channel_size, encoding.topk
        chunks = -(-numel // chunk)
        payload = encoding.payload
        flags_bytes = -(-chunks // 8)
        shifts = torch.arange(8, dtype=torch.int64, device=payload.device)
        full = (((payload[:flags_bytes].to(torch.int64)[:, None] >> shifts) & 1).reshape(-1)[:chunks]).bool()
        lengths = torch.full((chunks,), chunk, dtype=torch.int64, device=payload.device)
        if numel % chunk:
            lengths[-1] = numel % chunk
        counts = torch.clamp(lengths, max=topk)
        partial = int((~full).sum())
        said = payload[flags_bytes : flags_bytes + 2 * partial].to(torch.int64).view(-1, 2)
        counts[~full] = said[:, 0] | (said[:, 1] << 8)
        kept = int(counts.sum())
        width = index_bits(chunk)
        start = flags_bytes + 2 * partial
        index_end = start + -(-kept * width // 8)
        indices = _unpack_fixed(payload[start:index_end], width, kept)
        codes = _unpack_fixed(payload[index_end:], CODE_BITS, kept)
        chunk_of = torch.repeat_interleave(torch.arange(chunks, device=payload.device), counts)
        magnitudes = encoding.scale[codes]
        out[chunk_of * chunk + indices] = torch.where(codes >= 2, magnitudes, -magnitudes)


def twin(codec: SparseCodec) -> SparseTorchTwin:
    """The torch twin of ``codec`` (the registry calls this on first use)."""
    return SparseTorchTwin(codec)
