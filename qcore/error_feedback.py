"""Error feedback: carry what quantization dropped into the next send of the same key."""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import numpy as np

from gradq.qcore.codecs import codec_for
from gradq.qcore.quantized import QuantizedArray
from gradq.qcore.scheme import QuantConfig

__all__ = ["ErrorFeedback", "check_decay"]


def check_decay(decay: float) -> float:
    """``decay`` as a float if it is in (0, 1].

    Raises:
        ValueError: naming the value and the range.
    """
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
        raise ValueError(f"error_feedback_decay={decay!r} is invalid; expected a number in (0, 1] (1: no decay)")
    return float(decay)


class ErrorFeedback:
    """A residual per key: sends ``encode(x + decay * e)`` and keeps ``e <- (x + decay * e) - decode(...)``.

    Over many steps nothing is lost, only delayed, which is what lets 2- and
    4-bit gradients converge. A key whose size changes starts from zero again
    (DDP rebuilds its buckets after the first iteration), and so does one
    whose values could not be encoded (NaN/Inf: its step is not applied).

    Args:
        decay: what the residual keeps of itself before it is added, in (0, 1]:
            1 loses nothing; SparseLoCo's 0.95 lets old pseudo-gradients fade
            (the decayed residual then stands in for an outer momentum).

    Raises:
        ValueError: ``decay`` outside (0, 1].
    """

    __slots__ = ("_residuals", "decay")

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = check_decay(decay)
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
        flat = np.ascontiguousarray(np.asarray(x).reshape(-1), dtype=np.float32)
        residual = self._residuals.pop(key, None)
        if residual is None or residual.size != flat.size:
            residual = np.zeros_like(flat)
        elif self.decay != 1.0:
            np.multiply(residual, np.float32(self.decay), out=residual)
        # Popped while it is overwritten: a bucket refused for NaN/Inf (its step is not applied) leaves no residual.
        encoded = codec_for(config.scheme).encode_compensated(flat, residual, config, rng, str(np.asarray(x).dtype))
        self._residuals[key] = residual
        return encoded

    def residual(self, key: Hashable) -> np.ndarray | None:
        """The residual currently held for ``key`` (None if there is none)."""
        return self._residuals.get(key)

    def set_residual(self, key: Hashable, residual: np.ndarray) -> None:
        """Hold ``residual`` (flat float32) for ``key``, e.g. restored from a checkpoint."""
        self._residuals[key] = residual

    def keys(self) -> Iterator[Hashable]:
        """The keys that hold a residual."""
        return iter(list(self._residuals))

    def reset(self, key: Hashable | None = None) -> None:
        """Forget one key's residual, or all of them."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def __len__(self) -> int:
        return len(self._residuals)
