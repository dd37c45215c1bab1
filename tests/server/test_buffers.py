"""The accumulator pool: steady rounds reuse their accumulators, idle ones are unmapped."""

from __future__ import annotations

import mmap

import numpy as np
from round_calls import push, wait

from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server.buffers import MAPPED_MIN_BYTES, AccumulatorPool, mapped_float32
from gradq.server.job_spec import JobSpec
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable

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


def test_trim_to_unmaps_the_longest_freed_first_until_the_rest_fits() -> None:
    clock = Clock()
    pool = AccumulatorPool(idle_s=60.0, clock=clock)
    arrays = [pool.take(BIG * size) for size in (1, 2, 1)]
    for array in arrays:
        clock.now += 1.0
        pool.give(array)
    assert pool.free_bytes == 4 * BIG * 4
    assert pool.trim_to(4 * BIG * 4) == 0
    assert pool.trim_to(4 * BIG * 3) == 4 * BIG  # the oldest (the first small one) goes first
    assert pool.take(BIG) is arrays[2] and pool.take(2 * BIG) is arrays[1]
    assert pool.free_bytes == 0


def test_rounds_plus_free_accumulators_stay_within_the_memory_budget() -> None:
    numel = BIG
    limits = ServiceLimits(max_memory_bytes=6 * 4 * numel, max_job_memory_bytes=10**9)
    table = RoundTable(RoundPolicy(), limits=limits)
    config = QuantConfig(scheme=Scheme.FLOAT32)
    for job, size in (("small", numel), ("large", 2 * numel)):
        table.join(JobSpec(job, 0, 1))
        wait(table, push(table, job, 0, 0, 0, encode(np.ones(size, np.float32), config)))
        # Finished: its accumulator waits in the pool, and with the retained means it fits the budget.
        assert table.budget.in_use + table.accumulators.free_bytes <= table.budget.limit
    # 3 MiB of fp32 means retained: of the 3 MiB of free accumulators the older, small one made room.
    assert table.accumulators.free_bytes == 4 * 2 * numel
