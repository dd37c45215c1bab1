"""Round accumulators: kept for the next rounds of the same size while training runs, unmapped soon after.

A round's fp32 accumulator lives only as long as its round. Taken from the
heap (where gradq.proto.transport keeps blocks of up to 32 MiB for gRPC's
buffers), the freed accumulators of a burst of rounds stay resident,
fragmented between longer-lived blocks, long after the burst. Each
accumulator of 1 MiB or more is therefore an anonymous mapping of its own,
unmapped when the last view of it goes. A fresh mapping costs a zero-filled
page fault per 4 KiB on its first write, ~15x a decode into warm memory
(2.7 ms against 0.1-0.2 ms for 4 MiB here), so a training job's steady
rounds must not pay it every step: a freed accumulator waits in the pool
for the next round of its size, and one nobody has taken for
``idle_s`` is dropped by the sweeper.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable

import numpy as np

__all__ = ["AccumulatorPool", "mapped_float32"]

# Arrays at least this large get pages of their own; smaller ones come from the heap.
MAPPED_MIN_BYTES = 1 << 20


def mapped_float32(numel: int) -> np.ndarray:
    """An uninitialized float32 array of ``numel`` elements; from 1 MiB up, a mapping of its own."""
    if 4 * numel < MAPPED_MIN_BYTES:
        return np.empty(numel, np.float32)
    try:
        return np.frombuffer(mmap.mmap(-1, 4 * numel), np.float32)
    except OSError as error:  # ENOMEM: the same failure np.empty reports as MemoryError
        raise MemoryError(f"could not map {4 * numel} bytes for an accumulator: {error}") from error


class AccumulatorPool:
    """Freed accumulators by size, each kept at most ``idle_s`` seconds; thread-safe.

    Holds only what rounds held a moment ago, and nothing once rounds stop for
    ``idle_s``. Its pages are resident, so the table keeps what rounds hold
    plus what waits here under the memory budget (``trim_to``).

    Args:
        idle_s: a freed accumulator not taken again within this is unmapped.
        clock: monotonic seconds; tests may pass their own.
    """

    def __init__(self, idle_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[float, np.ndarray]]] = {}
        self._free_bytes = 0

    @property
    def free_bytes(self) -> int:
        """Bytes of accumulators waiting to be taken again."""
        return self._free_bytes

    def take(self, numel: int) -> np.ndarray:
        """An accumulator of ``numel`` float32 elements (uninitialized): a freed one if any, else new."""
        with self._lock:
            stack = self._free.get(numel)
            if stack:
                _, array = stack.pop()  # the most recently freed: its pages are the likeliest resident
                if not stack:
                    del self._free[numel]
                self._free_bytes -= array.nbytes
                return array
        return mapped_float32(numel)

    def give(self, array: np.ndarray) -> None:
        """Hand back an accumulator nothing else refers to any more (heap-sized ones are left to glibc)."""
        if array.nbytes < MAPPED_MIN_BYTES:
            return
        with self._lock:
            self._free.setdefault(array.size, []).append((self._clock(), array))
            self._free_bytes += array.nbytes

    def trim_to(self, max_bytes: int) -> int:
        """Unmap the longest-freed accumulators until at most ``max_bytes`` wait here; returns bytes dropped."""
        with self._lock:
            if self._free_bytes <= max_bytes:
                return 0
            by_age = sorted(
                (freed, numel, index) for numel, stack in self._free.items() for index, (freed, _) in enumerate(stack)
            )
            drop: set[tuple[int, int]] = set()
            left = self._free_bytes
            for _, numel, index in by_age:
                if left <= max_bytes:
                    break
                drop.add((numel, index))
                left -= 4 * numel
            return self._remove(lambda numel, index, _freed: (numel, index) in drop)

    def drop_idle(self) -> int:
        """Unmap accumulators freed more than ``idle_s`` ago (the sweeper calls this); returns bytes dropped."""
        cutoff = self._clock() - self.idle_s
        with self._lock:
            return self._remove(lambda _numel, _index, freed: freed < cutoff)

    def _remove(self, doomed: Callable[[int, int, float], bool]) -> int:
        """Drop the accumulators ``doomed(numel, index, freed_at)`` picks; caller holds the lock. Returns bytes."""
        dropped = 0
        for numel in list(self._free):
            stack = self._free[numel]
            kept = [(freed, array) for index, (freed, array) in enumerate(stack) if not doomed(numel, index, freed)]
            dropped += 4 * numel * (len(stack) - len(kept))
            if kept:
                self._free[numel] = kept
            else:
                del self._free[numel]
        self._free_bytes -= dropped
        return dropped  # the arrays are unmapped as the last references go, here
