"""A job's runs on the round table: step window, incarnations, every rank leaving, idle expiry, per-host caps."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from round_calls import push, wait

from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.errors import FailedPreconditionError, ResourceExhaustedError, RoundAbortedError
from gradq.server.job_spec import JobSpec
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable, RoundTicket

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def values(rank: int, step: int) -> np.ndarray:
    return np.full(4, float(10 * step + rank), np.float32)


def step_all(table: RoundTable, step: int, world: int = 2, incarnation: str = "") -> np.ndarray:
    """Every rank pushes ``step`` (rank 0 last) and the exact integer mean comes back."""
    tickets = [
        push(table, "job", step, 0, r, encode(values(r, step), EXACT), incarnation=incarnation) for r in range(world)
    ]
    means = {decode(wait(table, ticket).mean).tolist()[0] for ticket in tickets}
    assert means == {10 * step + (world - 1) / 2}
    return decode(wait(table, tickets[0]).mean)


def table_with(world: int = 2, incarnation: str = "", timeout: float = 5.0, **limits: object) -> RoundTable:
    table = RoundTable(RoundPolicy(round_timeout_s=timeout, retain_steps=2), limits=ServiceLimits(**limits))  # type: ignore[arg-type]
    for rank in range(world):
        table.join(JobSpec("job", rank, world, incarnation))
    return table


def test_a_far_ahead_step_is_refused_naming_both_bounds_and_changes_nothing() -> None:
    table = table_with(max_steps_ahead=4)
    for step in range(3):
        step_all(table, step)
    with pytest.raises(FailedPreconditionError, match=r"step=1002 is too far ahead: .* expected step in \[0, 6\]"):
        push(table, "job", 1002, 0, 1, encode(values(1, 1002), EXACT))
    assert table.in_flight() == 0
    for step in range(3, 8):
        step_all(table, step)


def test_a_failed_round_never_makes_later_steps_stale() -> None:
    table = table_with(timeout=0.2, max_steps_ahead=4)
    step_all(table, 0)
    stray = push(table, "job", 4, 0, 1, encode(values(1, 4), EXACT))  # in the window, never completed
    with pytest.raises(RoundAbortedError, match="ranks \\[0\\] missing"):
        wait(table, stray)
    threading.Event().wait(0.25)  # past the failure's answer period: step 4 may start afresh
    for step in range(1, 9):
        step_all(table, step)


def test_a_new_incarnation_starts_fresh_and_aborts_the_old_runs_rounds() -> None:
    table = table_with(incarnation="run-1")
    for step in range(50):
        step_all(table, step, incarnation="run-1")
    waiting: RoundTicket = push(table, "job", 50, 0, 0, encode(values(0, 50), EXACT), incarnation="run-1")
    table.join(JobSpec("job", 0, 2, "run-2"))  # torchrun restarted the job: rank 0 rejoins at step 0
    with pytest.raises(RoundAbortedError, match=r"superseded: job 'job' \(incarnation='run-1'\) was restarted"):
        wait(table, waiting)
    with pytest.raises(FailedPreconditionError, match=r"rank=1 has not joined job 'job' \(incarnation='run-2'\)"):
        push(table, "job", 0, 0, 1, encode(values(1, 0), EXACT), incarnation="run-2")
    table.join(JobSpec("job", 1, 2, "run-2"))
    step_all(table, 0, incarnation="run-2")  # step 0 is not stale in the new run
    with pytest.raises(FailedPreconditionError, match=r"incarnation='run-1' of job 'job' was superseded"):
        table.join(JobSpec("job", 1, 2, "run-1"))


def test_a_push_or_leave_of_another_incarnation_is_refused_naming_both() -> None:
    table = table_with(incarnation="run-2")
    expected = r"incarnation='run-1' does not match the current run of job 'job', incarnation='run-2'"
    with pytest.raises(FailedPreconditionError, match=expected):
        push(table, "job", 0, 0, 0, encode(values(0, 0), EXACT), incarnation="run-1")
    with pytest.raises(FailedPreconditionError, match=r"no incarnation does not match .* incarnation='run-2'"):
        table.leave("job", 0, "")
    assert table.active_jobs() == {"job": [0, 1]}
    step_all(table, 0, incarnation="run-2")


def test_every_rank_leaving_starts_the_job_fresh_and_fails_its_orphaned_round() -> None:
    table = table_with()
    for step in range(20):
        step_all(table, step)
    orphan = push(table, "job", 20, 0, 0, encode(values(0, 20), EXACT))
    table.leave("job", 1)
    table.leave("job", 0)
    with pytest.raises(RoundAbortedError):
        wait(table, orphan)
    assert table.in_flight() == 0 and table.active_jobs() == {}
    for rank in range(2):
        table.join(JobSpec("job", rank, 2))
    step_all(table, 0)  # the same job id, run again from step 0


def test_idle_jobs_expire_and_their_rounds_fail() -> None:
    now = [0.0]
    table = RoundTable(
        RoundPolicy(round_timeout_s=1e6), clock=lambda: now[0], limits=ServiceLimits(job_idle_timeout_s=60)
    )
    table.join(JobSpec("idle", 0, 2))
    ticket = push(table, "idle", 0, 0, 0, encode(values(0, 0), EXACT))
    now[0] = 61.0
    table.sweep()
    assert table.active_jobs() == {} and table.budget.in_use == 0
    with pytest.raises(RoundAbortedError, match="was idle for more than 60 s"):
        wait(table, ticket)


def test_5b_one_host_inventing_job_ids_cannot_take_the_whole_table() -> None:
    limits = ServiceLimits(max_jobs=20, max_jobs_per_peer=5, job_idle_timeout_s=60.0)
    table = RoundTable(RoundPolicy(), limits=limits)
    for number in range(5):
        table.join(JobSpec(f"storm-{number}", 0, 2), peer="ipv4:10.0.0.66")
    with pytest.raises(ResourceExhaustedError, match=r"client ipv4:10\.0\.0\.66 has started 5 jobs .*"
                       r"--max-jobs-per-peer=5"):  # fmt: skip
        table.join(JobSpec("storm-5", 0, 2), peer="ipv4:10.0.0.66")
    assert table.join(JobSpec("legit", 0, 2), peer="ipv4:10.0.0.7").joined == 1  # another host still starts its job
    table.join(JobSpec("storm-0", 1, 2), peer="ipv4:10.0.0.66")  # joining a job it started is not starting one
    table.leave("storm-0", 0)
    table.leave("storm-0", 1)  # forgotten: its slot is free again
    table.join(JobSpec("storm-5", 0, 2), peer="ipv4:10.0.0.66")
    assert len(table.active_jobs()) == 6
    # Restarted by another host under a new incarnation, a job keeps its slot with the host that started it.
    table.join(JobSpec("storm-1", 0, 2, incarnation="run-2"), peer="ipv4:10.0.0.7")
    with pytest.raises(ResourceExhaustedError, match="--max-jobs-per-peer=5"):
        table.join(JobSpec("storm-6", 0, 2), peer="ipv4:10.0.0.66")
    for number in range(4):
        table.join(JobSpec(f"other-{number}", 0, 2), peer="ipv4:10.0.0.7")  # legit plus these: its own 5
