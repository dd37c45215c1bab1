"""DiLoCo's outer step, in one order of float32 operations that every host and the aggregator share.

The outer optimizer is SGD with momentum (by default lr 0.3, momentum 0.9,
Nesterov: see bench/outer_lr.py for why not torchtitan's lr 0.7),
torch.optim.SGD's update without dampening or weight decay::

    buffer = momentum * buffer + mean
    direction = mean + momentum * buffer   (Nesterov; heavy-ball: buffer)
    parameters = parameters - lr * direction

Each line is numpy's elementwise float32 operations, one rounding each, so
the same inputs give the same bits on every machine; torch's fused
``add(alpha=)`` may use a fused multiply-add and differ in the last bit. That
is why the hosts run this function, on their tensors' memory, rather than
torch's SGD: the aggregator's copy of the global parameters, which joiners
receive, stays the hosts' bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DEFAULT_OUTER_LR", "DEFAULT_OUTER_MOMENTUM", "OuterStep", "take_outer_step"]

# The default outer step. lr 0.3, not torchtitan's 0.7: on 4 tasks (2 held back from tuning), 2, 4 and 8
# hosts and H = 10 and 50, 0.3 lost at most 4% held-out loss to the best of 0.3/0.5/0.7/0.9 and 0.7 up
# to 62%; the number of hosts did not move the best lr (bench/outer_lr.py, docs/diloco.md).
DEFAULT_OUTER_LR = 0.3
DEFAULT_OUTER_MOMENTUM = 0.9


@dataclass(frozen=True, slots=True)
class OuterStep:
    """The outer optimizer's settings; the job's hosts and its aggregator must hold the same.

    Raises:
        ValueError: ``lr`` is not a finite number > 0, or ``momentum`` is not in [0, 1).
    """

    lr: float = DEFAULT_OUTER_LR
    momentum: float = DEFAULT_OUTER_MOMENTUM
    nesterov: bool = True

    def __post_init__(self) -> None:
        # Stored as float32 values: what crosses the wire (OuterStep in gradq.proto) is what both sides use.
        object.__setattr__(self, "lr", float(np.float32(self.lr)))
        object.__setattr__(self, "momentum", float(np.float32(self.momentum)))
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r} is invalid; expected a finite outer learning rate > 0")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ValueError(f"momentum={self.momentum!r} is invalid; expected a number in [0, 1)")
        object.__setattr__(self, "nesterov", bool(self.nesterov))

    def describe(self) -> str:
        """``lr=0.7 momentum=0.9 nesterov=True``, for messages."""
        return f"lr={self.lr:g} momentum={self.momentum:g} nesterov={self.nesterov}"


def take_outer_step(parameters: np.ndarray, momentum: np.ndarray, mean: np.ndarray, step: OuterStep) -> None:
    """One outer step in place: ``momentum`` and ``parameters`` move by the averaged pseudo-gradient ``mean``.

    Args:
        parameters: the global parameters (float32, contiguous), updated in place.
        momentum: the momentum buffer (float32, as many), updated in place; zeros before the first step.
        mean: the averaged pseudo-gradient (float32, as many), left as it is.
        step: the settings.

    Raises:
        ValueError: the arrays differ in size or are not float32.
    """
    for name, array in (("parameters", parameters), ("momentum", momentum), ("mean", mean)):
        if array.dtype != np.float32 or array.size != parameters.size:
            raise ValueError(
                f"{name} has dtype={array.dtype}, size={array.size}; expected float32 of {parameters.size} elements"
            )
    mu, lr = np.float32(step.momentum), np.float32(step.lr)
    np.multiply(momentum, mu, out=momentum)
    np.add(momentum, mean, out=momentum)
    if step.nesterov:
        direction = np.multiply(momentum, mu)
        np.add(direction, mean, out=direction)
    else:
        direction = momentum.copy()
    np.multiply(direction, lr, out=direction)
    np.subtract(parameters, direction, out=parameters)
