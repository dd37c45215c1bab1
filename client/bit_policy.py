"""Bits per bucket piece under a target average: the few sensitive parameters get more, the bulk the low bits.

A DDP bucket lays its parameters end to end. The adaptive policy splits it at
parameter boundaries into pieces, each pushed as its own round on its own grid
(the aggregator fixes a grid per bucket key, see gradq.server.step_window), and
chooses the bits of each parameter greedily:

1. every parameter starts at the low bits (the configured ones);
2. 1-D parameters (biases, norm scales and shifts) come first, then the
   others in order of their gradient's measured relative error at the low
   bits (an embedding's gradient, zero in the rows a batch never touched, is
   the typical worst); each is raised to the first of ``HIGHER_BITS`` that
   still keeps the element-weighted average of the bucket's bits at or under
   the target, else left low.

Every bucket stays under the target, so the whole model does. The bits counted
are the levels' (``QuantConfig.bits``); the per-channel scale and zero point add
the same 64 / channel_size bits to each (0.5 at the low-bit default of 128).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradq.qcore import QuantConfig, Scheme, decode, encode

__all__ = [
    "BIT_POLICIES",
    "DEFAULT_AVERAGE_BITS",
    "HIGHER_BITS",
    "ParameterGradient",
    "Piece",
    "assign_bits",
    "check_average_bits",
    "plan_pieces",
    "relative_error_at",
]

BIT_POLICIES = ("uniform", "adaptive")
# The adaptive policy's default target: 2-bit pushes with half a bit per element to spare.
DEFAULT_AVERAGE_BITS = 2.5
# What a raised parameter gets: 8 bits if the budget allows, else 4.
HIGHER_BITS = (8, 4)


@dataclass(frozen=True, slots=True)
class ParameterGradient:
    """What the policy knows of one parameter of a bucket."""

    numel: int
    ndim: int
    error: float  # ||Q(g) - g|| / ||g|| of its gradient on the low-bit grid; 0.0 when unknown


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of consecutive bucket elements pushed as one round on one grid."""

    begin: int
    end: int
    config: QuantConfig


def check_average_bits(average_bits: float, low_bits: int) -> None:
    """Refuse a target the low bits already exceed (or one past 8).

    Raises:
        ValueError: naming the value and the accepted range.
    """
    if not low_bits <= average_bits <= 8:
        raise ValueError(
            f"average_bits={average_bits!r} is out of range; expected {low_bits}..8 (the low bits up to 8)"
        )


def assign_bits(params: Sequence[ParameterGradient], low_bits: int, average_bits: float) -> list[int]:
    """Bits for each parameter, element-weighted average <= ``average_bits`` (see the module docstring).

    Args:
        params: the bucket's parameters in bucket order.
        low_bits: what every parameter gets unless raised.
        average_bits: the target average over the bucket's elements.

    Returns:
        One entry per parameter, in order.

    Raises:
        ValueError: ``average_bits`` is below ``low_bits`` or above 8.
    """
    check_average_bits(average_bits, low_bits)
    bits = [low_bits] * len(params)
    spare = average_bits * sum(p.numel for p in params) - low_bits * sum(p.numel for p in params)
    order = sorted(range(len(params)), key=lambda i: (params[i].ndim > 1, -params[i].error, params[i].numel))
    for index in order:
        for higher in HIGHER_BITS:
            cost = (higher - low_bits) * params[index].numel
            if higher > low_bits and cost <= spare + 1e-9:
                bits[index] = higher
                spare -= cost
                break
    return bits


def plan_pieces(numels: Sequence[int], bits: Sequence[int], low: QuantConfig) -> list[Piece]:
    """Runs of consecutive parameters with equal bits, each a piece on its own grid.

    Raised pieces use the per-channel affine grid at their bits (a scaled sign
    has no more bits to give), with the low config's rounding and seed.
    """
    pieces: list[Piece] = []
    offset = 0
    for numel, count in zip(numels, bits, strict=True):
        if pieces and pieces[-1].config.bits == count and pieces[-1].end == offset:
            pieces[-1] = Piece(pieces[-1].begin, offset + numel, pieces[-1].config)
        else:
            config = low if count == low.bits else _raised(low, count)
            pieces.append(Piece(offset, offset + numel, config))
        offset += numel
    return pieces


def _raised(low: QuantConfig, bits: int) -> QuantConfig:
    return QuantConfig(Scheme.PER_CHANNEL_AFFINE, bits, rounding=low.rounding, seed=low.seed)


def relative_error_at(values: np.ndarray, config: QuantConfig) -> float:
    """``||decode(encode(values)) - values|| / ||values||`` on ``config`` (0.0 for a zero or empty gradient)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(flat))
    if norm == 0.0 or not np.isfinite(norm):
        return 0.0
    return float(np.linalg.norm(decode(encode(flat, config)) - flat)) / norm
