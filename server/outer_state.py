"""DiLoCo on the aggregator: a job's global parameters and outer momentum, one pair of arrays per round key.

A job that joined with an outer step (JoinRequest.outer_step) gets an
``OuterState``. Its members seed it (SeedOuter) with the global state they
hold before an outer round; after that, every round of the job that finishes
moves the key's state by the mean the members received, with the same float32
operations they run (gradq.qcore.outer_step), so the aggregator's copy stays
theirs bit for bit. Once every key has moved past an outer round, the state is
whole at that boundary: the aggregator itself sends it to the joiners waiting
(``snapshot``), so no member has to.

An aggregator that restarts holds none: the members seed it again from their
copies (they keep one to compute their pseudo-gradients), momentum included,
so a restart loses nothing. A round finished while a key is unseeded moves
nothing here; the member that seeds next brings that round in.

Thread model: ``lock`` guards everything and is a leaf (the memory budget's
lock is taken after it only by the caller, never under it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from gradq.qcore.outer_step import OuterStep, take_outer_step
from gradq.server.errors import FailedPreconditionError, InvalidArgumentError

__all__ = ["MAX_OUTER_KEYS", "KeyState", "OuterState", "Seeded"]

# The most round keys one outer round may hold: bounds the per-key bookkeeping a client can ask for.
MAX_OUTER_KEYS = 1 << 16


@dataclass(eq=False, slots=True)
class KeyState:
    """One round key's global parameters and momentum, as they stand before outer round ``step``."""

    parameters: np.ndarray
    momentum: np.ndarray
    step: int

    @property
    def nbytes(self) -> int:
        return int(self.parameters.nbytes + self.momentum.nbytes)


@dataclass(frozen=True, slots=True)
class Seeded:
    """What a seed found: whether the aggregator now holds exactly it, and its copy when not."""

    matched: bool
    step: int
    held: tuple[bytes, bytes] | None  # the aggregator's copy (parameters, momentum) to adopt, when not matched
    new_bytes: int  # what this seed added to the job's state (charged by the caller)


@dataclass(eq=False)
class OuterState:
    """A job's outer step and the global state it moves (see the module docstring)."""

    step: OuterStep
    keys: int = 0  # round keys per outer round, fixed by the first seed (0: none yet)
    held: dict[int, KeyState] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(state.nbytes for state in self.held.values())

    def seed(
        self, key: int, keys: int, step: int, parameters: np.ndarray, momentum: np.ndarray | None, describe: str
    ) -> Seeded:
        """Take one key's state if none is held (or the one held is of an earlier outer round), else compare.

        Args:
            key: the round key.
            keys: the round keys per outer round, as the member counts them.
            step: the outer round the state starts.
            parameters: float32 global parameters of the key.
            momentum: float32 momentum, as many (None: zeros).
            describe: names the job, for messages.

        Raises:
            InvalidArgumentError: ``keys`` out of range, ``key`` not below it, or the sizes disagree.
            FailedPreconditionError: ``keys`` differs from the job's, or the key's size from the one held.
        """
        if not 1 <= keys <= MAX_OUTER_KEYS:
            raise InvalidArgumentError(f"keys={keys} is invalid; expected 1..{MAX_OUTER_KEYS} round keys per round")
        if key >= keys:
            raise InvalidArgumentError(f"key={key} is out of range; expected 0..{keys - 1} (keys={keys})")
        if momentum is not None and momentum.size != parameters.size:
            raise InvalidArgumentError(
                f"momentum holds {momentum.size} elements, parameters {parameters.size}; expected as many "
                f"(or no momentum before the first outer round)"
            )
        with self.lock:
            if self.keys and keys != self.keys:
                raise FailedPreconditionError(
                    f"keys={keys} does not match {describe}, whose outer rounds hold {self.keys} round keys; "
                    f"every host must lay out the same model in the same buckets"
                )
            self.keys = keys
            held = self.held.get(key)
            if held is None:
                zeros = momentum if momentum is not None else np.zeros_like(parameters)
                state = KeyState(parameters.copy(), zeros.copy() if momentum is not None else zeros, step)
                self.held[key] = state
                return Seeded(True, step, None, state.nbytes)
            if held.parameters.size != parameters.size:
                raise FailedPreconditionError(
                    f"key {key} holds {parameters.size} elements here, {held.parameters.size} in {describe}; "
                    f"every host must lay out the same model in the same buckets"
                )
            if step > held.step:  # the hosts are past this copy (a resumed checkpoint): theirs is the job's now
                held.parameters[:] = parameters
                held.momentum[:] = momentum if momentum is not None else 0.0
                held.step = step
                return Seeded(True, step, None, 0)
            same_momentum = np.array_equal(held.momentum, momentum) if momentum is not None else not held.momentum.any()
            matched = held.step == step and same_momentum and np.array_equal(held.parameters, parameters)
            copy = None if matched else (held.parameters.tobytes(), held.momentum.tobytes())
            return Seeded(matched, held.step, copy, 0)

    def advance(self, key: int, step: int, mean: np.ndarray) -> bool:
        """Round ``(step, key)`` finished with ``mean`` (as the members decode it): take the outer step.

        Returns:
            True when this made the state whole at outer round ``step + 1``: every key is held and there.
        """
        with self.lock:
            held = self.held.get(key)
            if held is None or held.step != step or held.parameters.size != mean.size:
                return False  # unseeded (a restart), or a round this copy does not stand before
            take_outer_step(held.parameters, held.momentum, mean, self.step)
            held.step = step + 1
            return self._whole_at(step + 1)

    def snapshot(self, step: int) -> bytes | None:
        """The whole state at outer round ``step`` as a joiner receives it, or None if it is not whole there.

        Every key's parameters in ascending key order, then every key's
        momentum in the same order, float32 LE.
        """
        with self.lock:
            if not self._whole_at(step):
                return None
            ordered = [self.held[key] for key in sorted(self.held)]
            return b"".join([state.parameters.tobytes() for state in ordered] + [m.momentum.tobytes() for m in ordered])

    def forget(self) -> int:
        """Drop every key (the job ended); returns the bytes they held."""
        with self.lock:
            held = sum(state.nbytes for state in self.held.values())
            self.held.clear()
            return held

    def _whole_at(self, step: int) -> bool:
        return bool(self.keys) and len(self.held) == self.keys and all(s.step == step for s in self.held.values())
