"""Pushes to rounds that failed: answered with the failure at once, the ranks realign, the memory stays bounded.

Driven on the round table with an injected clock: a rank "late past the
deadline" is one whose push arrives after the clock has moved past it. The
same scenario with real processes and SIGSTOP is in
tests/reliability/test_faults.py.
"""

from __future__ import annotations

import gc
import logging
import tracemalloc

import numpy as np
import pytest
import round_calls

from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.errors import InvalidArgumentError, ResourceExhaustedError, RoundAbortedError
from gradq.server.job_spec import JobSpec
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy
from gradq.server.round_state import FAILED_ROUND_BYTES
from gradq.server.rounds import RoundTable, RoundTicket
from gradq.server.step_window import GRID_ENTRY_BYTES

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
TIMEOUT_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def values(rank: int, step: int) -> np.ndarray:
    return np.full(4, float(10 * step + rank), np.float32)


def table_of(world: int, clock: Clock, **limits: object) -> RoundTable:
    table = RoundTable(RoundPolicy(round_timeout_s=TIMEOUT_S), clock=clock, limits=ServiceLimits(**limits))  # type: ignore[arg-type]
    for rank in range(world):
        table.join(JobSpec("job", rank, world))
    return table


def push(table: RoundTable, step: int, rank: int, bucket: int = 0) -> RoundTicket:
    return round_calls.push(table, "job", step, bucket, rank, encode(values(rank, step), EXACT))


def answered_at_once(table: RoundTable, ticket: RoundTicket) -> bool:
    """True when the ticket's round is already finished: ``watch`` has no deadline to wait for."""
    return table.watch(ticket, _NoWaker()) is None


class _NoWaker:
    def set(self) -> None:  # pragma: no cover - only kept for a round still open
        raise AssertionError("a finished round has no waiters to wake")


def pass_deadline(table: RoundTable, clock: Clock) -> None:
    """Let the round timeout pass and have the sweeper close what is due."""
    clock.now += TIMEOUT_S
    table.sweep()


def test_a_rank_late_past_the_deadline_gets_the_failure_at_once_and_the_ranks_realign() -> None:
    clock = Clock()
    table = table_of(3, clock)
    for step in range(2):
        tickets = [push(table, step, rank) for rank in range(3)]
        assert decode(round_calls.wait(table, tickets[0]).mean)[0] == 10 * step + 1
    # Rank 2 stops before step 2; ranks 0 and 1 go on, failing one step per deadline.
    failed = {}
    for step in (2, 3, 4):
        failed[step] = [push(table, step, rank) for rank in (0, 1)]
        pass_deadline(table, clock)
        for ticket in failed[step]:
            with pytest.raises(RoundAbortedError, match=r"ranks \[2\] missing"):
                table.answer(ticket)
    others = [push(table, 5, rank) for rank in (0, 1)]  # opened; rank 2 wakes up during it
    # Rank 2 resumes: steps 2 to 4 failed long ago (more than a deadline plus a round timeout for
    # step 2); each of its pushes gets that failure at once instead of a new round and a deadline.
    for step in (2, 3, 4):
        late = push(table, step, 2)
        assert answered_at_once(table, late), step
        with pytest.raises(RoundAbortedError, match=rf"step={step}, .*ranks \[2\] missing"):
            table.answer(late)
    # ... and it joins the step the others are at: from there every step completes for everyone.
    mine = push(table, 5, 2)
    for ticket in (*others, mine):
        assert decode(round_calls.wait(table, ticket).mean)[0] == 51
    for step in range(6, 10):
        tickets = [push(table, step, rank) for rank in (2, 0, 1)]
        for ticket in tickets:
            assert decode(round_calls.wait(table, ticket).mean)[0] == 10 * step + 1
    assert table.in_flight() == 0
    assert table.counters["rounds_failed"] == 3


def test_a_retry_of_a_failed_round_gets_its_failure_however_late() -> None:
    clock = Clock()
    table = table_of(2, clock)
    first = push(table, 0, 0)
    pass_deadline(table, clock)
    with pytest.raises(RoundAbortedError):
        table.answer(first)
    push(table, 1, 0)  # rank 0 moves on
    clock.now += 50 * TIMEOUT_S
    for rank in (0, 1):  # rank 0's retry, rank 1's late push: neither opens the round again
        retry = push(table, 0, rank)
        assert answered_at_once(table, retry)
        with pytest.raises(RoundAbortedError, match=r"step=0, bucket=0\) failed: deadline"):
            table.answer(retry)


def test_a_stray_round_that_nothing_moved_past_starts_afresh_after_its_answer_period() -> None:
    clock = Clock()
    table = table_of(2, clock, max_steps_ahead=4)
    for step in range(2):
        tickets = [push(table, step, rank) for rank in (0, 1)]
        round_calls.wait(table, tickets[0])
    stray = push(table, 5, 1)  # in the window, ahead of the others
    pass_deadline(table, clock)
    with pytest.raises(RoundAbortedError):
        table.answer(stray)
    clock.now += TIMEOUT_S  # the stray's answer period is over and no later step was opened
    for step in range(2, 7):
        tickets = [push(table, step, rank) for rank in (0, 1)]
        for ticket in tickets:
            assert decode(round_calls.wait(table, ticket).mean)[0] == 10 * step + 0.5


def test_a_remembered_failure_is_charged_to_its_job_and_dropped_with_its_step() -> None:
    clock = Clock()
    table = table_of(2, clock)
    push(table, 0, 0)
    pass_deadline(table, clock)
    failure = table.jobs.all()[0].rounds[(0, 0)]
    assert failure.charged == FAILED_ROUND_BYTES + len(str(failure.error))
    assert failure.contributors == set() and failure.digests == {} and failure.arrivals == {}
    assert table.budget.in_use == failure.charged + GRID_ENTRY_BYTES  # and bucket 0's grid
    for step in range(1, 5):  # the window moves past step 0: its failure goes, and its charge
        tickets = [push(table, step, rank) for rank in (0, 1)]
        round_calls.wait(table, tickets[0])
    assert (0, 0) not in table.jobs.all()[0].rounds
    retained = sum(rnd.charged for rnd in table.jobs.all()[0].rounds.values())
    assert table.budget.in_use - GRID_ENTRY_BYTES == retained == 3 * table.jobs.all()[0].rounds[(4, 0)].charged


def test_a_member_failing_rounds_on_purpose_exhausts_only_its_own_share() -> None:
    clock = Clock()
    share = 64 << 10
    table = table_of(2, clock, max_job_memory_bytes=share, max_memory_bytes=16 * share)
    table.join(JobSpec("other", 0, 1))
    poisoned = encode(np.zeros(4, np.float32), EXACT)
    refused: tuple[int, str] | None = None
    for bucket in range(10_000):  # a new round key every time, each failed at once (NaN under --non-finite reject)
        try:
            ticket = round_calls.push(table, "job", 0, bucket, 0, poisoned, non_finite=True)
        except ResourceExhaustedError as exhausted:
            refused = bucket, str(exhausted)
            break
        with pytest.raises(InvalidArgumentError):
            table.answer(ticket)
    assert refused is not None, "remembered failures must count against the job's memory"
    bucket, message = refused
    assert "--max-job-memory-bytes" in message
    failures = FAILED_ROUND_BYTES + 200
    assert bucket <= share // FAILED_ROUND_BYTES + 1 and bucket >= share // failures - 1
    held = table.jobs.all()[0].memory.in_use
    assert held <= share + failures
    # Every other job keeps its rounds.
    mean = round_calls.wait(table, round_calls.push(table, "other", 0, 0, 0, encode(values(0, 0), EXACT)))
    assert decode(mean.mean)[0] == 0.0


def test_a_failed_rounds_record_holds_less_than_it_is_charged() -> None:
    clock = Clock()
    world = 64
    table = table_of(world, clock, max_open_rounds=10_000)
    rounds = 300
    tensor = encode(np.ones(4, np.float32), EXACT)
    for bucket in range(8):  # warm every path first
        round_calls.push(table, "job", 0, 1000 + bucket, 0, tensor)
    pass_deadline(table, clock)
    gc.collect()
    logging.disable(logging.WARNING)  # pytest keeps every log record: its memory is not the round's
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for bucket in range(rounds):
            for rank in range(world - 1):
                round_calls.push(table, "job", 0, bucket, rank, tensor)
        pass_deadline(table, clock)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    job = table.jobs.all()[0]
    charged = sum(job.rounds[(0, bucket)].charged for bucket in range(rounds))
    print(f"a failed round of world {world} holds {held / rounds:.0f} bytes, charged {charged / rounds:.0f}")
    assert held <= charged
