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
nothing here (logged); the member that seeds next brings that round in.

Seeds and pushes are held to one job:

- a key's size is fixed by whichever comes first, its first seed or its first
  push; the other, and any later seed or push of another size, is refused
  naming the key and both sizes (a mismatch would otherwise leave the copy
  never moving, and every joiner waiting for it);
- a seed holding NaN or Inf is refused, whatever --non-finite says: the copy is
  every host's next starting point, and one bad host would poison them all;
- the job's outer round (``newest``) is the newest one a seed or a push has
  brought: a host at outer round 7 holds more training than one at 5. A seed
  of an older round is answered with the job's round and holds nothing; a push
  that would open a round older than it is refused at once (Refusal.BEHIND,
  naming both rounds), and its host takes the job's state from this copy at
  the next outer-round boundary, as a late host does (gradq.server.rounds).

Every key is charged at what it costs: its arrays plus ``KEY_ENTRY_BYTES``.

Thread model: ``lock`` guards everything; under it only the memory budget's
lock (a leaf) is taken. ``check_push`` runs under the job table's lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from gradq.qcore.outer_step import OuterStep, take_outer_step
from gradq.server.budget import MemoryAccount, MemoryBudget
from gradq.server.errors import FailedPreconditionError, InvalidArgumentError, Refusal

__all__ = ["KEY_ENTRY_BYTES", "MAX_OUTER_KEYS", "KeyState", "OuterState", "Seeded"]

log = logging.getLogger(__name__)

# The most round keys one outer round may hold on one aggregator: bounds the per-key bookkeeping a client
# can ask for. The keys themselves are sparse: a bucket's chunks are keyed bucket + chunk * 2^32, and on
# several shards each holds every shards-th of them (gradq.client.chunks).
MAX_OUTER_KEYS = 1 << 16
MAX_ROUND_KEY = (1 << 64) - 1

# What one round key holds beside its arrays' elements: its KeyState, two array headers and their smallest
# allocations, its entries in ``held`` and ``sizes`` and its int. bench/outer_key_memory.py measured 20,000
# one-element keys at 438 B of RSS each, their 8 B of values included (charged 520: 1.19x); 5,000 keys of
# 256 elements at 2,341 B (charged 2,560). Charged as a bucket's grid is (step_window.GRID_ENTRY_BYTES).
KEY_ENTRY_BYTES = 512


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
    step: int  # the outer round the aggregator's copy of the key starts (the job's, when this seed was older)
    held: tuple[bytes, bytes] | None  # the aggregator's copy (parameters, momentum) to adopt, when not matched
    new_bytes: int  # what this seed added to the job's state (charged by the caller)
    moved: bool = False  # this seed moved the job's outer round forward: older rounds in flight are behind
    whole: bool = False  # the state is whole at ``step`` now: joiners waiting may take it


@dataclass(eq=False)
class OuterState:
    """A job's outer step and the global state it moves (see the module docstring)."""

    step: OuterStep
    keys: int = 0  # round keys per outer round, fixed by the first seed (0: none yet)
    held: dict[int, KeyState] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # key -> its elements, fixed by its first seed or push
    newest: int = -1  # the job's outer round: the newest a seed or a push brought (-1: none yet)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        """What the state holds, as charged: every key's entry and arrays."""
        with self.lock:
            return KEY_ENTRY_BYTES * len(self.sizes) + sum(state.nbytes for state in self.held.values())

    def charge_for_seed(self, key: int, parameters: np.ndarray) -> int:
        """What a seed of ``key`` would add if nothing else adds the key first (charged before it is taken)."""
        with self.lock:
            return (KEY_ENTRY_BYTES if key not in self.sizes else 0) + (
                2 * parameters.nbytes if key not in self.held else 0
            )

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
            InvalidArgumentError: ``keys`` out of range, ``key`` not below it, the sizes disagree, or a
                value is NaN or Inf (nothing held changes).
            FailedPreconditionError: ``keys`` differs from the job's, or the key's size from the one its
                first seed or push fixed.
        """
        if not 1 <= keys <= MAX_OUTER_KEYS:
            raise InvalidArgumentError(f"keys={keys} is invalid; expected 1..{MAX_OUTER_KEYS} round keys per round")
        if key > MAX_ROUND_KEY:
            raise InvalidArgumentError(f"key={key} is out of range; expected a round key 0..{MAX_ROUND_KEY}")
        if momentum is not None and momentum.size != parameters.size:
            raise InvalidArgumentError(
                f"momentum holds {momentum.size} elements, parameters {parameters.size}; expected as many "
                f"(or no momentum before the first outer round)"
            )
        _check_finite("parameters", key, parameters)
        if momentum is not None:
            _check_finite("momentum", key, momentum)
        with self.lock:
            if self.keys and keys != self.keys:
                raise FailedPreconditionError(
                    f"keys={keys} does not match {describe}, whose outer rounds hold {self.keys} round keys; "
                    f"every host must lay out the same model in the same buckets"
                )
            _check_size(self.sizes.get(key), key, parameters.size, "seed", describe)
            _check_room(self.sizes, keys, key, "seed", describe)
            if step < self.newest:  # the job has moved on: this host takes its state when it next pushes
                return Seeded(False, self.newest, None, 0)
            moved = step > self.newest
            self.keys, self.newest = keys, step
            new_bytes = 0 if key in self.sizes else KEY_ENTRY_BYTES
            self.sizes[key] = parameters.size
            held = self.held.get(key)
            if held is None:
                zeros = momentum if momentum is not None else np.zeros_like(parameters)
                state = KeyState(parameters.copy(), zeros.copy() if momentum is not None else zeros, step)
                self.held[key] = state
                return Seeded(True, step, None, new_bytes + state.nbytes, moved, self._whole_at(step))
            if step > held.step:  # the hosts are past this copy (a resumed checkpoint): theirs is the job's now
                held.parameters[:] = parameters
                held.momentum[:] = momentum if momentum is not None else 0.0
                held.step = step
                return Seeded(True, step, None, new_bytes, moved, self._whole_at(step))
            same_momentum = np.array_equal(held.momentum, momentum) if momentum is not None else not held.momentum.any()
            matched = held.step == step and same_momentum and np.array_equal(held.parameters, parameters)
            copy = None if matched else (held.parameters.tobytes(), held.momentum.tobytes())
            return Seeded(matched, held.step, copy, new_bytes)

    def check_push(
        self, key: int, step: int, numel: int, opens: bool, describe: str, budget: MemoryBudget, account: MemoryAccount
    ) -> bool:
        """A push of ``numel`` elements to round ``(step, key)``: refuse it unless it fits the job's state.

        The push's size becomes the key's if neither a seed nor a push fixed
        it (the key's entry is charged to ``account`` then).

        Args:
            opens: the push would open the round (no round of ``(step, key)`` is held).

        Returns:
            Whether the push moved the job's outer round forward (the rounds in flight before it are behind).

        Raises:
            InvalidArgumentError: ``key`` past MAX_OUTER_KEYS.
            FailedPreconditionError: ``key`` not below the job's keys, another size than the key's, or
                (Refusal.BEHIND) a round to open older than the job's outer round.
            ResourceExhaustedError: the budget cannot hold a new key's entry.
        """
        if key > MAX_ROUND_KEY:
            raise InvalidArgumentError(f"bucket={key} is out of range; expected a round key 0..{MAX_ROUND_KEY}")
        with self.lock:
            _check_room(self.sizes, self.keys or MAX_OUTER_KEYS, key, "push", describe)
            size = self.sizes.get(key)
            _check_size(size, key, numel, "push", describe)
            if opens and step < self.newest:
                raise FailedPreconditionError(
                    f"outer round {step} (step={step}, bucket={key}) is behind {describe}, whose global state is at "
                    f"outer round {self.newest}; expected step >= {self.newest}: this host takes the job's state from "
                    f"the aggregator at the next outer-round boundary (FetchState)",
                    Refusal.BEHIND,
                )
            if size is None:
                budget.charge(KEY_ENTRY_BYTES, f"round key {key} of the global state of {describe}", account)
                self.sizes[key] = numel
            moved = step > self.newest
            self.newest = max(self.newest, step)
            return moved

    def advance(self, key: int, step: int, mean: np.ndarray, describe: str) -> bool:
        """Round ``(step, key)`` finished with ``mean`` (as the members decode it): take the outer step.

        A round that moves nothing is logged with why: the key is not seeded
        (after a restart, until the hosts seed), or the copy stands before
        another outer round (a seed moved it past this round while it closed,
        or hosts pushed past a stale copy; the next seed replaces it).

        Returns:
            True when this made the state whole at outer round ``step + 1``: every key is held and there.
        """
        with self.lock:
            held = self.held.get(key)
            if held is None:
                log.info(
                    "%s: round (step=%d, key=%d) moves no global state on the aggregator: the key is not seeded "
                    "(the hosts' next seed brings this round in)",
                    describe,
                    step,
                    key,
                )
                return False
            if held.step != step or held.parameters.size != mean.size:
                log.warning(
                    "%s: round (step=%d, key=%d) of %d elements moves no global state on the aggregator: its copy "
                    "of the key stands before outer round %d and holds %d elements; it moves again once a host "
                    "seeds the job's round",
                    describe,
                    step,
                    key,
                    mean.size,
                    held.step,
                    held.parameters.size,
                )
                return False
            take_outer_step(held.parameters, held.momentum, mean, self.step)
            held.step = step + 1
            return self._whole_at(step + 1)

    def snapshot(self, step: int) -> bytearray | None:
        """The whole state at outer round ``step`` as a joiner receives it, or None if it is not whole there.

        Every key's parameters in ascending key order, then every key's
        momentum in the same order, float32 LE. One copy, written in place:
        a copy per array joined into a second one held the state three times
        at the boundary (a 4 GiB state peaked 8 GiB over its own size with a
        joiner waiting, bench/outer_shards.py).
        """
        with self.lock:
            if not self._whole_at(step):
                return None
            ordered = [self.held[key] for key in sorted(self.held)]
            arrays = [state.parameters for state in ordered] + [state.momentum for state in ordered]
            data = bytearray(sum(array.nbytes for array in arrays))
            out = np.frombuffer(data, np.float32)
            offset = 0
            for array in arrays:
                out[offset : offset + array.size] = array
                offset += array.size
            return data

    def forget(self) -> int:
        """Drop every key (the job ended); returns the bytes they were charged."""
        with self.lock:
            held = KEY_ENTRY_BYTES * len(self.sizes) + sum(state.nbytes for state in self.held.values())
            self.held.clear()
            self.sizes.clear()
            return held

    def _whole_at(self, step: int) -> bool:
        return bool(self.keys) and len(self.held) == self.keys and all(s.step == step for s in self.held.values())


def _check_room(sizes: dict[int, int], keys: int, key: int, what: str, describe: str) -> None:
    """Refuse a new key past the ``keys`` an outer round holds here (the per-key bookkeeping stays bounded)."""
    if key not in sizes and len(sizes) >= keys:
        raise FailedPreconditionError(
            f"a {what} of round key {key} is one too many for {describe}, whose outer rounds hold {keys} round keys "
            f"on this aggregator (fixed by its first seed), all of them known already; every host must lay out the "
            f"same model in the same buckets over the same shards"
        )


def _check_size(fixed: int | None, key: int, numel: int, what: str, describe: str) -> None:
    if fixed is not None and numel != fixed:
        raise FailedPreconditionError(
            f"a {what} of key {key} holds {numel} elements; expected {fixed}, the size of key {key} in {describe} "
            f"(fixed by its first seed or push): every host must lay out the same model in the same buckets"
        )


def _check_finite(name: str, key: int, values: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise InvalidArgumentError(
            f"{name} of key {key} holds {values[bad[0]]} at index {bad[0]} ({bad.size} values not finite); "
            f"expected finite float32 values: the global state is every host's next start, so it is never "
            f"seeded with NaN or Inf, whatever --non-finite says"
        )
