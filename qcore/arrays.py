"""A worker's buckets in one array library: encode (with error feedback), decode the mean in place, measure.

``WorkerClient`` runs the same chunking, shards, window, retries and stats
for any bucket and leaves the arithmetic to one of these: ``NumpyArrays`` for
host arrays, ``gradq.qcore.torch_codec``'s ``TorchArrays`` for tensors on any
device (loaded only when a tensor is pushed, so qcore imports no torch).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterator
from typing import Any, Protocol

import numpy as np

from gradq.qcore.codec import decode, encode
from gradq.qcore.error_feedback import ErrorFeedback
from gradq.qcore.quantized import QuantizedArray
from gradq.qcore.scheme import QuantConfig

__all__ = ["ARRAY_LIBRARIES", "ArrayCodec", "NumpyArrays", "ResidualStore", "library_of", "new_arrays"]

# The array libraries a bucket may live in.
ARRAY_LIBRARIES = ("numpy", "torch")


class ResidualStore(Protocol):
    """Error-feedback residuals by key: what a checkpoint saves and restores."""

    def residual(self, key: Hashable) -> Any:
        """The residual held for ``key`` (None if there is none)."""

    def set_residual(self, key: Hashable, residual: Any) -> None:
        """Hold ``residual`` for ``key``."""

    def keys(self) -> Iterator[Hashable]:
        """The keys that hold a residual."""

    def reset(self, key: Hashable | None = None) -> None:
        """Forget one key's residual, or all of them."""


class ArrayCodec(Protocol):
    """What ``WorkerClient`` asks of an array library."""

    library: str  # "numpy" or "torch"

    @property
    def error_feedback(self) -> ResidualStore | None:
        """The residuals by key; None when error feedback is off."""

    def flatten(self, values: Any) -> Any:
        """A flat view of a bucket."""

    def output(self, out: Any | None, numel: int, like: Any) -> Any:
        """``out`` checked as a writeable flat float32 buffer of ``numel`` elements, or a new one beside ``like``."""

    def encode(
        self, key: int, values: Any, rng: np.random.Generator, config: QuantConfig | None = None
    ) -> QuantizedArray:
        """Encode a flat slice on ``config`` (None: the codec's own), with ``key``'s residual under error feedback."""

    def decode(self, mean: QuantizedArray, out: Any) -> None:
        """Decode a received mean into ``out`` (a flat float32 slice), finished when this returns."""

    def relative_error(self, key: int, values: Any, encoded: QuantizedArray) -> float | None:
        """``||sent - values|| / ||values||`` (None for a zero input)."""


class NumpyArrays:
    """ArrayCodec for numpy arrays on the host.

    Args:
        config: the wire grid.
        error_feedback: keep a residual per key.
        decay: the residuals' decay (see ``gradq.qcore.ErrorFeedback``).
    """

    library = "numpy"

    def __init__(self, config: QuantConfig, error_feedback: bool, decay: float = 1.0) -> None:
        self.config = config
        self.error_feedback = ErrorFeedback(decay) if error_feedback else None

    def flatten(self, values: Any) -> np.ndarray:
        """``values`` as a flat array (a view when it can be)."""
        return np.asarray(values).reshape(-1)

    def output(self, out: np.ndarray | None, numel: int, like: Any) -> np.ndarray:
        """A new flat float32 array, or ``out`` checked.

        Raises:
            ValueError: ``out`` is not a writeable contiguous float32 array of ``numel`` elements.
        """
        if out is None:
            return np.empty(numel, np.float32)
        if out.dtype != np.float32 or out.size != numel or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(
                f"out has dtype={out.dtype}, size={out.size}, contiguous={out.flags.c_contiguous}, "
                f"writeable={out.flags.writeable}; expected a writeable contiguous float32 array of {numel} elements"
            )
        return out.reshape(-1)

    def encode(
        self, key: int, values: np.ndarray, rng: np.random.Generator, config: QuantConfig | None = None
    ) -> QuantizedArray:
        """``encode`` or, with error feedback, ``ErrorFeedback.encode``, on ``config`` (None: ``self.config``)."""
        config = config or self.config
        if self.error_feedback is not None:
            return self.error_feedback.encode(key, values, config, rng=rng)
        return encode(values, config, rng=rng)

    def decode(self, mean: QuantizedArray, out: np.ndarray) -> None:
        """``decode(mean, out=out)``."""
        decode(mean, out=out)

    def relative_error(self, key: int, values: np.ndarray, encoded: QuantizedArray) -> float | None:
        """The residual's norm under error feedback (it is exactly what was lost), else decode's."""
        norm = float(np.linalg.norm(values))
        if norm == 0.0:
            return None
        if self.error_feedback is not None:
            residual = self.error_feedback.residual(key)
            return float(np.linalg.norm(residual)) / norm if residual is not None else None
        return float(np.linalg.norm(decode(encoded) - values.reshape(-1))) / norm


def library_of(values: Any) -> str:
    """ "torch" for a torch tensor (on any device), "numpy" for anything else."""
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return "torch" if torch is not None and isinstance(values, torch.Tensor) else "numpy"


def new_arrays(library: str, config: QuantConfig, error_feedback: bool, decay: float = 1.0) -> ArrayCodec:
    """A fresh ArrayCodec of ``library`` (see ``ARRAY_LIBRARIES``).

    Args:
        library: "numpy" or "torch" (imports torch).
        config: the wire grid.
        error_feedback: keep a residual per key.
        decay: the residuals' decay (see ``gradq.qcore.ErrorFeedback``).

    Raises:
        ValueError: an unknown library.
    """
    if library == "numpy":
        return NumpyArrays(config, error_feedback, decay)
    if library == "torch":
        from gradq.qcore.torch_codec import TorchArrays

        return TorchArrays(config, error_feedback, decay)
    raise ValueError(f"library={library!r} is not an array library; expected one of {', '.join(ARRAY_LIBRARIES)}")
