"""The array codecs one client encodes with, one per array library it has pushed, and their residuals."""

from __future__ import annotations

from typing import Any

from gradq.qcore import QuantConfig, QuantizedArray
from gradq.qcore.arrays import ArrayCodec, ResidualStore, library_of, new_arrays

__all__ = ["ArrayCodecs"]

# Every this-many pushes one is measured against its input: the norms cost as much as encoding.
_SAMPLE_EVERY = 16


class ArrayCodecs:
    """One ArrayCodec per library pushed so far: numpy arrays, or torch tensors on any device.

    A tensor's codec (and its residuals) stays on the tensor's device, so
    only packed bytes cross to the host.

    Args:
        config: the client's grid.
        error_feedback: each codec keeps a residual per round key.
    """

    def __init__(self, config: QuantConfig, error_feedback: bool) -> None:
        self._config = config
        self._error_feedback = error_feedback
        self._codecs: dict[str, ArrayCodec] = {}
        self._pushes_since_sample = 0

    def of(self, values: Any) -> ArrayCodec:
        """The codec of ``values``' library (made on first use)."""
        return self.of_library(library_of(values))

    def of_library(self, library: str) -> ArrayCodec:
        """The codec of ``library`` ("numpy" or "torch"), made on first use."""
        codec = self._codecs.get(library)
        if codec is None:
            codec = self._codecs[library] = new_arrays(library, self._config, self._error_feedback)
        return codec

    def libraries(self) -> list[str]:
        """The libraries encoded with so far: the ones that may hold residuals."""
        return list(self._codecs)

    def residuals(self, library: str) -> ResidualStore | None:
        """The residuals of ``library``'s pushes by round key (None when error feedback is off)."""
        return self.of_library(library).error_feedback

    def sampled_error(self, codec: ArrayCodec, key: int, values: Any, tensor: QuantizedArray) -> float | None:
        """||decoded - input|| / ||input|| of every 16th push; None for the others."""
        self._pushes_since_sample = (self._pushes_since_sample + 1) % _SAMPLE_EVERY
        if self._pushes_since_sample != 1:
            return None
        return codec.relative_error(key, values, tensor)
