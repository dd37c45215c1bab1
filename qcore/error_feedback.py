"""Error feedback: carry what quantization dropped into the next send of the same key."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from gradq.qcore.codec import QuantizedArray, decode, encode
from gradq.qcore.scheme import QuantConfig

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """A residual per key: sends ``encode(x + e)`` and keeps ``e <- (x + e) - decode(...)``.

    Over many steps nothing is lost, only delayed, which is what lets 2- and
    4-bit gradients converge. A key whose size changes starts from zero again
    (DDP rebuilds its buckets after the first iteration).
    """

    __slots__ = ("_residuals",)

    def __init__(self) -> None:
        self._residuals: dict[Hashable, np.ndarray] = {}

    def encode(
        self, key: Hashable, x: np.ndarray, config: QuantConfig, *, rng: np.random.Generator | None = None
    ) -> QuantizedArray:
        """Compensate ``x`` with the residual of ``key``, encode it, and remember the new residual.

        Args:
            key: identifies the stream (bucket) whose errors are carried.
            x: the values to send (flattened, float32).
            config: the wire scheme.
            rng: generator for stochastic rounding.

        Returns:
            The encoded compensated values.
        """
        compensated = np.array(x, dtype=np.float32, copy=True).reshape(-1)
        residual = self._residuals.get(key)
        if residual is not None and residual.size == compensated.size:
            compensated += residual
        else:
            residual = np.empty_like(compensated)
        encoded = encode(compensated, config, rng=rng, dtype=str(np.asarray(x).dtype))
        decode(encoded, out=residual)
        np.subtract(compensated, residual, out=residual)
        self._residuals[key] = residual
        return encoded

    def residual(self, key: Hashable) -> np.ndarray | None:
        """The residual currently held for ``key`` (None if there is none)."""
        return self._residuals.get(key)

    def restore(self, key: Hashable, residual: np.ndarray) -> None:
        """Hold ``residual`` for ``key`` (e.g. from a checkpoint); the next ``encode`` of that size adds it.

        Args:
            key: the stream (bucket) it belongs to.
            residual: what earlier sends of ``key`` lost (flattened to float32).
        """
        self._residuals[key] = np.array(residual, dtype=np.float32, copy=True).reshape(-1)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget one key's residual, or all of them."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def __len__(self) -> int:
        return len(self._residuals)
