"""What the status page shows: jobs, their counts and the last failed rounds, copied out under the locks briefly.

The snapshot is plain values: the page renders it after every lock is let go,
and it never takes a round's lock at all (a round being decoded is not waited for).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from gradq.server.job import Job
from gradq.server.metrics import JobTotals, RoundMetrics
from gradq.server.reports import RoundReport
from gradq.server.rounds import RoundTable

__all__ = ["ErrorRow", "JobRow", "RecentErrors", "StatusSnapshot", "take_snapshot"]

# Rows the page shows at most, so its size does not grow with what clients invent.
DEFAULT_MAX_JOB_ROWS = 50
DEFAULT_MAX_ERROR_ROWS = 20
# Client-supplied strings beyond this are cut (job ids may hold 256 characters, messages more).
_MAX_TEXT = 300


@dataclass(frozen=True, slots=True)
class ErrorRow:
    """One failed round: when (wall-clock seconds), which job, the reason code and what its waiters were told."""

    at: float
    job_id: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class JobRow:
    """One live job: its run and members from the table, its counts from the metrics."""

    job_id: str
    incarnation: str
    world_size: int
    joined: tuple[int, ...]  # members present (joined, neither left nor lost)
    pending: tuple[int, ...]  # elastic newcomers waiting for the training state
    left: tuple[int, ...]  # members that joined this run and left
    lost: tuple[int, ...]  # members whose Watch stream ended without a Leave
    step: int  # newest step with a round open or completed (-1: none yet)
    open_rounds: int
    memory_in_use: int  # bytes of the budget this run holds
    memory_limit: int
    idle_s: float  # since its last Join, PushPull or Leave
    totals: JobTotals  # every run of this job id since the aggregator started (as /metrics counts)


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    """Everything one page shows, taken at ``taken_at`` (wall-clock seconds)."""

    taken_at: float
    server_id: str
    uptime_s: float
    jobs: tuple[JobRow, ...]  # the most recently active first, at most max_jobs of them
    jobs_total: int  # live jobs in all
    rounds_in_flight: int
    memory_in_use: int
    memory_limit: int
    errors: tuple[ErrorRow, ...]  # newest first


class RecentErrors:
    """A RoundObserver that keeps the last failed rounds for the status page.

    Args:
        keep: failed rounds remembered (the oldest is forgotten first).
        clock: wall-clock seconds, for the time shown beside each error.
    """

    def __init__(self, keep: int = DEFAULT_MAX_ERROR_ROWS, clock: Callable[[], float] = time.time) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} is invalid; expected >= 1")
        self._clock = clock
        self._lock = threading.Lock()  # rounds fail on any of the server's threads
        self._rows: deque[ErrorRow] = deque(maxlen=keep)

    def round_finished(self, report: RoundReport) -> None:
        """Remember ``report`` if its round failed."""
        if report.outcome != "failed":
            return
        row = ErrorRow(self._clock(), report.job_id[:_MAX_TEXT], report.reason, report.error[:_MAX_TEXT])
        with self._lock:
            self._rows.append(row)

    def newest_first(self) -> tuple[ErrorRow, ...]:
        """The remembered failures, newest first."""
        with self._lock:
            return tuple(reversed(self._rows))


def take_snapshot(
    table: RoundTable,
    metrics: RoundMetrics,
    errors: RecentErrors,
    server_id: str,
    started_at: float,
    max_jobs: int = DEFAULT_MAX_JOB_ROWS,
    clock: Callable[[], float] = time.time,
) -> StatusSnapshot:
    """Copy what the page shows out of the table (under its job lock only), the metrics and the error list.

    Args:
        table: the aggregator's jobs and rounds.
        metrics: its Prometheus series (the counts per job id).
        errors: its recent failed rounds.
        server_id: the aggregator's id (Join answers carry it too).
        started_at: wall-clock seconds when the aggregator started.
        max_jobs: rows shown at most; the most recently active jobs are kept.
        clock: wall-clock seconds.

    Returns:
        The snapshot, plain values only.
    """
    now = table.now()
    with table.jobs.lock:
        jobs = sorted(table.jobs.all(), key=lambda job: job.last_active, reverse=True)
        rows = [_job_row(job, now) for job in jobs[:max_jobs]]
        in_flight = sum(len(job.open) for job in jobs)
    totals = metrics.totals()
    return StatusSnapshot(
        taken_at=clock(),
        server_id=server_id,
        uptime_s=clock() - started_at,
        jobs=tuple(_with_totals(row, totals) for row in rows),
        jobs_total=len(jobs),
        rounds_in_flight=in_flight,
        memory_in_use=table.budget.in_use,
        memory_limit=table.budget.limit,
        errors=errors.newest_first(),
    )


def _job_row(job: Job, now: float) -> JobRow:
    """The table's part of a row. Caller holds the job table's lock."""
    members = job.members.states()
    # A round's step is fixed when it opens, so it is read without the round's lock.
    step = max((rnd.step for rnd in job.open), default=job.newest_completed_step)
    return JobRow(
        job_id=job.job_id[:_MAX_TEXT],
        incarnation=job.incarnation[:_MAX_TEXT],
        world_size=job.world_size,
        joined=members.training,
        pending=members.pending,
        left=members.left,
        lost=members.lost,
        step=max(step, job.newest_completed_step),
        open_rounds=len(job.open),
        memory_in_use=job.memory.in_use,
        memory_limit=job.memory.limit,
        idle_s=max(0.0, now - job.last_active),
        totals=JobTotals(rounds={}),
    )


def _with_totals(row: JobRow, totals: dict[str, JobTotals]) -> JobRow:
    found = totals.get(row.job_id)
    return row if found is None else replace(row, totals=found)
