"""The accumulator pool: steady rounds reuse their accumulators, idle ones are unmapped."""

from __future__ import annotations

import mmap

import numpy as np

from gradq.server.buffers import MAPPED_MIN_BYTES, AccumulatorPool, mapped_float32

BIG = MAPPED_MIN_BYTES // 4  # elements of the smallest mapped accumulator


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_large_accumulators_are_mappings_of_their_own_and_small_ones_come_from_the_heap() -> None:
    big, small = mapped_float32(BIG), mapped_float32(BIG - 1)
    assert isinstance(big.base, memoryview) and isinstance(big.base.obj, mmap.mmap)
    assert not isinstance(small.base, memoryview)
    big[:] = 3.0  # writable
    assert big.dtype == np.float32 and big.size == BIG and float(big.sum()) == 3.0 * BIG


def test_a_freed_accumulator_is_reused_by_the_next_round_of_its_size() -> None:
    pool = AccumulatorPool(idle_s=2.0, clock=Clock())
    first = pool.take(BIG)
    pool.give(first)
    assert pool.take(BIG + 1) is not first  # another size: a new one
    assert pool.take(BIG) is first
    assert pool.free_bytes == 0


def test_accumulators_nobody_takes_are_dropped_after_idle_s() -> None:
    clock = Clock()
    pool = AccumulatorPool(idle_s=2.0, clock=clock)
    old, recent = pool.take(BIG), pool.take(BIG)
    pool.give(old)
    clock.now = 1.5
    pool.give(recent)
    clock.now = 2.5
    assert pool.drop_idle() == old.nbytes
    assert pool.free_bytes == recent.nbytes
    clock.now = 4.0
    assert pool.drop_idle() == recent.nbytes and pool.free_bytes == 0


def test_heap_sized_accumulators_are_left_to_the_allocator() -> None:
    pool = AccumulatorPool(clock=Clock())
    pool.give(pool.take(16))
    assert pool.free_bytes == 0
