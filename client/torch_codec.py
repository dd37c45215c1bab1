"""qcore's grid in torch ops, so GPU gradients are quantized on the device.

Only the packed levels and qparams cross to the host. The arithmetic mirrors
``gradq.qcore._kernels`` step for step (float64 qparams, float32 division,
round-half-to-even, LSB-first packing), so payloads are byte-identical to
``gradq.qcore.encode`` for the same input (tested on CPU tensors).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradq.qcore import QuantConfig, QuantizedArray, Rounding, encode
from gradq.qcore.codec import LARGEST_QUANTIZABLE

__all__ = ["quantize_tensor", "torch_dtype_name"]

_SMALLEST_SCALE = float(np.finfo(np.float32).smallest_subnormal)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch float dtype ("float32", "float16", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def _qparams(lo: torch.Tensor, hi: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale float32, zero_point int64) from float32 ranges; nearest-rounding grid."""
    qmax = config.qmax
    mid = (qmax + 1) // 2
    lo64, hi64 = lo.double(), hi.double()
    lo_w, hi_w = lo64.clamp(max=0.0), hi64.clamp(min=0.0)
    span = (hi_w - lo_w).clamp(min=_SMALLEST_SCALE)  # avoids 0/0 on constant channels, replaced below
    if config.scheme.is_symmetric:
        scale = torch.maximum(-lo_w, hi_w) / (qmax / 2.0)
        zero_point = torch.full_like(lo64, mid)
    else:
        scale = span / qmax
        zero_point = torch.round(-lo_w / scale).clamp(0, qmax)
    constant = lo64 == hi64
    constant_zero_point = torch.full_like(lo64, mid) if config.scheme.is_symmetric else (lo64 < 0).double()
    scale = torch.where(constant, lo64.abs(), scale)
    zero_point = torch.where(constant, constant_zero_point, zero_point)
    all_zero = constant & (lo64 == 0)
    scale = torch.where(all_zero, torch.ones_like(scale), scale).clamp(min=_SMALLEST_SCALE)
    return scale.float(), zero_point.long()


def _pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
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
    return packed[: math.ceil(numel * bits / 8)]


def quantize_tensor(
    tensor: torch.Tensor, config: QuantConfig, *, dtype: str | None = None
) -> tuple[QuantizedArray, torch.Tensor]:
    """Quantize on ``tensor``'s device; copy only packed levels and qparams to the host.

    Args:
        tensor: any float tensor (flattened).
        config: a quantized scheme with nearest rounding.
        dtype: element type to record for the receiver; defaults to ``tensor``'s.

    Returns:
        (the QuantizedArray, the dequantized values on the device as float32) —
        the latter lets error feedback stay on the device.

    Raises:
        ValueError: a float or stochastic scheme (use ``gradq.qcore.encode``), or a
            value that is NaN, Inf or ``|x| >= 2**126``.
    """
    if not config.scheme.is_quantized or config.rounding is not Rounding.NEAREST:
        raise ValueError(
            f"scheme={config.scheme.name.lower()}, rounding={config.rounding.name.lower()} is not supported on "
            "the device; expected a quantized scheme with nearest rounding"
        )
    flat = tensor.detach().reshape(-1).float()
    numel = flat.numel()
    channel_size = config.channel_size if config.scheme.is_per_channel else max(numel, 1)
    channels = -(-numel // channel_size) if config.scheme.is_per_channel else 1
    if numel == 0:  # nothing to move: qcore states the empty case once
        return encode(np.empty(0, np.float32), config, dtype=dtype or torch_dtype_name(tensor.dtype)), flat
    # Pad with the last value, which leaves the last channel's min and max unchanged.
    padded = torch.cat([flat, flat[-1:].expand(channels * channel_size - flat.numel())]).view(channels, channel_size)
    lo, hi = padded.amin(dim=1), padded.amax(dim=1)
    magnitude = torch.maximum(lo.abs(), hi.abs())
    if not bool((magnitude < LARGEST_QUANTIZABLE).all()):  # NaN compares False too
        index = int(torch.nonzero(~(flat.abs() < LARGEST_QUANTIZABLE))[0])
        raise ValueError(f"x[{index}]={float(flat[index])} cannot be encoded; expected finite values with |x| < 2**126")
    scale, zero_point = _qparams(lo, hi, config)
    levels_float = (torch.round(padded / scale[:, None]) + zero_point[:, None].float()).clamp(0, config.qmax)
    dequantized = (scale[:, None] * (levels_float - zero_point[:, None].float())).reshape(-1)[:numel]
    levels = levels_float.to(torch.uint8).reshape(-1)[:numel]
    payload = _pack(levels, config.bits)
    encoded = QuantizedArray(
        scheme=config.scheme,
        bits=config.bits,
        numel=numel,
        channel_size=channel_size,
        scale=scale.cpu().numpy(),
        zero_point=zero_point.to(torch.int32).cpu().numpy(),
        payload=payload.cpu().numpy(),
        dtype=dtype or torch_dtype_name(tensor.dtype),
    )
    return encoded, dequantized
