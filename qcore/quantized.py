"""The encoded form every codec produces and every layer passes around, and the value range codecs accept."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradq.qcore.scheme import Scheme

__all__ = ["LARGEST_QUANTIZABLE", "METADATA_BYTES", "QuantizedArray", "refuse_out_of_range"]

# Fixed fields of the wire message (scheme, bits, numel, channel_size, dtype tag,
# field headers); a deliberate upper bound so wire_size never under-reports.
METADATA_BYTES = 32

# Quantized schemes refuse |x| >= 2**126 (see _kernels): such gradients mean a diverged
# run, and refusing them keeps every decoded value finite. Observers refuse them too.
LARGEST_QUANTIZABLE = float(2.0**126)


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedArray:
    """A flat array on the wire grid: levels packed densely plus their qparams.

    Attributes:
        scheme: the grid (or float pass-through) the payload is on; a ``Scheme``.
        bits: bits per element in ``payload`` (16/32 for the float schemes).
        numel: number of elements encoded.
        channel_size: elements per channel (``numel`` for per-tensor schemes).
        scale: float32, one per channel (one for per-tensor; empty for floats).
        zero_point: int32, one per channel, each in ``0..2**bits-1`` (empty for the scaled sign, which has none).
        payload: uint8 bytes, ``ceil(numel * bits / 8)`` of them.
        dtype: the sender's element type, so the receiver can cast back.
        topk: the most entries a chunk keeps, for the sparse scheme; 0 for every other.
    """

    scheme: Scheme
    bits: int
    numel: int
    channel_size: int
    scale: np.ndarray
    zero_point: np.ndarray
    payload: np.ndarray
    dtype: str = "float32"
    topk: int = 0

    @property
    def num_channels(self) -> int:
        """How many (scale, zero_point) pairs the array carries."""
        return int(self.scale.size)

    @property
    def nbytes(self) -> int:
        """Bytes this array occupies on the wire, metadata included."""
        return METADATA_BYTES + self.payload.nbytes + self.scale.nbytes + self.zero_point.nbytes


def refuse_out_of_range(x: np.ndarray, limit: float, what: str, offset: int = 0, verb: str = "encoded") -> None:
    """Raise for the first element of ``x`` with ``not |x| < limit`` (NaN included).

    Args:
        x: a flat float array.
        limit: the exclusive bound on ``|x|``.
        what: what was expected, for the message.
        offset: index of ``x[0]`` in the caller's array, so the message names the caller's index.
        verb: what could not be done to the value ("encoded", "observed").

    Raises:
        ValueError: ``x[i]=v cannot be <verb>; expected <what>``.
    """
    bad = ~(np.abs(x) < limit)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(f"x[{offset + index}]={float(x[index])} cannot be {verb}; expected {what}")
