"""The round: accumulate each rank's bucket as it arrives, average, answer every waiter.

Plain Python (no grpc), so tests drive it directly. One fp32 accumulator per
round in flight; contributions are dequantized into it on arrival, so memory is
O(bucket), not O(world x bucket). Lock order: a round's lock may be taken
before the table's, never the other way round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from gradq.qcore import ErrorFeedback, QuantizedArray, decode, encode
from gradq.server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    RoundAbortedError,
    RoundError,
    UnavailableError,
)
from gradq.server.policy import PushedGrid, RoundPolicy, return_config_for
from gradq.server.reports import RoundObserver, RoundReport
from gradq.server.round_state import Round, RoundResult

__all__ = ["RoundTable", "RoundResult", "RoundTicket", "MAX_JOB_ID_LENGTH"]

log = logging.getLogger(__name__)

MAX_JOB_ID_LENGTH = 256


@dataclass(frozen=True, slots=True)
class RoundTicket:
    """A contribution accepted by ``push``; hand it to ``wait`` for the answer."""

    job_id: str
    job: _Job
    round: Round
    rank: int


@dataclass(slots=True)
class _Job:
    world_size: int
    joined: set[int] = field(default_factory=set)
    # (step, bucket) -> round, in flight or finished-and-retained for retries.
    rounds: dict[tuple[int, int], Round] = field(default_factory=dict)
    newest_finished_step: int = -1
    error_feedback: ErrorFeedback = field(default_factory=ErrorFeedback)


class RoundTable:
    """All jobs and rounds of one aggregator.

    Args:
        policy: deadlines, quorum and return scheme.
        clock: monotonic seconds; tests may pass their own.
        package: turns a finished round's result into its wire answer, once
            per round (stored as ``RoundResult.packaged``).
        observer: told about every finished round (metrics).
        job_finished: called with a job's id once its last joined rank has left
            (``gradq serve --exit-after-jobs`` counts these).
    """

    def __init__(
        self,
        policy: RoundPolicy,
        clock: Callable[[], float] = time.monotonic,
        package: Callable[[RoundResult], object] | None = None,
        observer: RoundObserver | None = None,
        job_finished: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._package = package
        self._observer = observer
        self._job_finished = job_finished
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._closing = False
        self.counters = {
            "rounds_completed": 0,
            "rounds_partial": 0,
            "rounds_skipped": 0,
            "rounds_failed": 0,
            "contributions": 0,
        }

    # -- membership -------------------------------------------------------------------------

    def join(self, job_id: str, rank: int, world_size: int) -> tuple[int, list[int]]:
        """Register ``rank`` with ``job_id``; idempotent, so a restarted worker may rejoin.

        Returns:
            (the job's world size, the ranks joined so far).

        Raises:
            InvalidArgumentError: empty/oversized job id, world size < 1, rank out of range.
            FailedPreconditionError: world size disagrees with the job's or the server's.
        """
        _check_job_id(job_id)
        if world_size < 1:
            raise InvalidArgumentError(f"world_size={world_size} is invalid; expected >= 1")
        if self.policy.world_size and world_size != self.policy.world_size:
            raise FailedPreconditionError(
                f"world_size={world_size} does not match this aggregator's --world-size={self.policy.world_size}"
            )
        if rank >= world_size:
            raise InvalidArgumentError(
                f"rank={rank} is out of range; expected 0..{world_size - 1} for world_size={world_size}"
            )
        with self._lock:
            if self._closing:
                raise UnavailableError("the aggregator is shutting down; join another shard or retry after restart")
            job = self._jobs.get(job_id)
            if job is None:
                job = self._jobs[job_id] = _Job(world_size)
            elif job.world_size != world_size:
                raise FailedPreconditionError(
                    f"world_size={world_size} does not match job {job_id!r}, which has world_size={job.world_size}"
                )
            rejoined = rank in job.joined
            job.joined.add(rank)
            joined = sorted(job.joined)
        log.info(
            "%s rank %d of %d to job %r (%d joined)",
            "rejoin" if rejoined else "join",
            rank,
            world_size,
            job_id,
            len(joined),
        )
        return world_size, joined

    def leave(self, job_id: str, rank: int) -> None:
        """Deregister ``rank``; rounds still waiting for it close now instead of at their deadline."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or rank not in job.joined:
                return
            job.joined.discard(rank)
            waiting = [r for r in job.rounds.values() if not r.done.is_set()]
            finished = not job.joined
            if finished:
                del self._jobs[job_id]
        log.info("leave rank %d from job %r", rank, job_id)
        for rnd in waiting:
            with rnd.lock:
                if not rnd.done.is_set() and rank not in rnd.contributors:
                    self._close_early(job_id, job, rnd, f"rank {rank} left the job", "rank_left")
        if finished and self._job_finished is not None:
            self._job_finished(job_id)

    # -- the round --------------------------------------------------------------------------

    def contribute(
        self, job_id: str, step: int, bucket: int, rank: int, tensor: QuantizedArray, non_finite: bool = False
    ) -> RoundResult:
        """``wait(push(...))``: add ``rank``'s bucket to the round and wait for the mean."""
        return self.wait(self.push(job_id, step, bucket, rank, tensor, non_finite))

    def push(
        self, job_id: str, step: int, bucket: int, rank: int, tensor: QuantizedArray, non_finite: bool = False
    ) -> RoundTicket:
        """Add ``rank``'s bucket to round (job, step, bucket); returns at once.

        The tensor is dequantized into the round's accumulator before this
        returns, so the caller can drop it (and its message) before waiting.
        A duplicate of an accepted contribution is not counted again.
        ``non_finite`` says the rank's bucket held NaN/Inf (``tensor`` then only
        carries its size): under the reject policy the round fails for every
        rank, under the skip policy it completes with a zero mean marked skipped.

        Raises:
            InvalidArgumentError: numel disagrees with the round's.
            FailedPreconditionError: unknown job or rank, or a stale step.
            UnavailableError: the aggregator is shutting down and the round is new.
        """
        if tensor.numel > self.policy.max_bucket_elements:
            raise InvalidArgumentError(
                f"tensor.numel={tensor.numel} is too large; this aggregator accepts buckets of up to "
                f"{self.policy.max_bucket_elements} elements (--max-bucket-elements)"
            )
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise FailedPreconditionError(f"job {job_id!r} has no joined ranks; call Join first")
            if rank not in job.joined:
                raise FailedPreconditionError(
                    f"rank={rank} has not joined job {job_id!r} (joined: {sorted(job.joined)}); call Join first"
                )
            rnd = job.rounds.get((step, bucket))
            if rnd is None:
                oldest = job.newest_finished_step - self.policy.retain_steps
                if step < oldest:
                    raise FailedPreconditionError(
                        f"step={step} is stale: job {job_id!r} has finished rounds up to step "
                        f"{job.newest_finished_step}; expected step >= {oldest}"
                    )
                if self._closing:
                    raise UnavailableError("the aggregator is shutting down; no new rounds are started")
                grid = PushedGrid(tensor.scheme, tensor.bits, tensor.channel_size, tensor.numel, tensor.dtype)
                rnd = Round(step, bucket, grid, self._clock() + self.policy.round_timeout_s)
                job.rounds[(step, bucket)] = rnd
            elif tensor.numel != rnd.pushed.numel:
                raise InvalidArgumentError(
                    f"tensor.numel={tensor.numel} does not match numel={rnd.pushed.numel} of "
                    f"{rnd.describe(job_id)}; every rank must send the same bucket size"
                )
        with rnd.lock:
            if not rnd.done.is_set() and rank not in rnd.contributors:
                if not non_finite:
                    rnd.accumulate(tensor, last=len(rnd.contributors) + 1 == job.world_size)
                elif self.policy.non_finite == "reject":
                    reason = f"rank {rank} reported NaN/Inf gradients; the policy is to reject them (--non-finite)"
                    error = InvalidArgumentError(f"{rnd.describe(job_id)} failed: {reason}")
                    self._fail(job_id, job, rnd, error, "non_finite")
                    return RoundTicket(job_id, job, rnd, rank)
                else:
                    rnd.non_finite.add(rank)
                rnd.contributors.add(rank)
                rnd.arrivals[rank] = self._clock()
                rnd.received_bytes += tensor.nbytes
                if len(rnd.contributors) == job.world_size:
                    self._finish(job_id, job, rnd)
        return RoundTicket(job_id, job, rnd, rank)

    def wait(self, ticket: RoundTicket) -> RoundResult:
        """Block until the ticket's round finishes (at most until its deadline) and answer.

        Raises:
            FailedPreconditionError: a partial round closed without this rank.
            RoundAbortedError: the round's deadline passed with ranks missing.
            UnavailableError: the aggregator shut down before the round completed.
        """
        rnd = ticket.round
        if not rnd.done.wait(max(0.0, rnd.deadline - self._clock())):
            with rnd.lock:
                if not rnd.done.is_set():
                    reason = f"deadline of {self.policy.round_timeout_s:g} s passed"
                    self._close_early(ticket.job_id, ticket.job, rnd, reason, "deadline")
        return _answer(ticket.job_id, rnd, ticket.rank)

    def _finish(self, job_id: str, job: _Job, rnd: Round, missing: tuple[int, ...] = (), reason: str = "") -> None:
        """Average, re-encode and release the waiters. Caller holds ``rnd.lock``."""
        mean = rnd.mean()
        if rnd.non_finite:
            log.warning("%s skipped: ranks %s reported NaN/Inf", rnd.describe(job_id), sorted(rnd.non_finite))
        config = return_config_for(self.policy, rnd.pushed)
        try:
            if self.policy.server_error_feedback:
                encoded = job.error_feedback.encode(rnd.bucket, mean, config)
            else:
                encoded = encode(mean, config, dtype=rnd.pushed.dtype)
        except ValueError:
            error = InvalidArgumentError(
                f"{rnd.describe(job_id)}: the mean is not finite (contributions overflow float32)"
            )
            self._fail(job_id, job, rnd, error, "overflow")
            return
        if self._observer is not None:
            rnd.relative_error = _relative_error(mean, encoded)
        result = RoundResult(encoded, tuple(sorted(rnd.contributors)), missing, skipped=bool(rnd.non_finite))
        rnd.result = replace(result, packaged=self._package(result)) if self._package else result
        log.debug("%s complete over %d ranks", rnd.describe(job_id), len(rnd.contributors))
        outcome = "skipped" if rnd.non_finite else "partial" if missing else "completed"
        self._release(job_id, job, rnd, outcome, reason)

    def _close_early(self, job_id: str, job: _Job, rnd: Round, reason: str, code: str) -> None:
        """Close a round that lacks ranks: partial over a quorum, else fail. Caller holds ``rnd.lock``."""
        missing = tuple(sorted(set(range(job.world_size)) - rnd.contributors))
        quorum = self.policy.partial_quorum
        if quorum and len(rnd.contributors) >= quorum:
            log.warning(
                "%s closed partial (%s): averaged ranks %s, missing ranks %s",
                rnd.describe(job_id),
                reason,
                sorted(rnd.contributors),
                list(missing),
            )
            self._finish(job_id, job, rnd, missing, code)
            return
        error = RoundAbortedError(
            f"{rnd.describe(job_id)} failed: {reason} with ranks {list(missing)} missing "
            f"(have {sorted(rnd.contributors)} of world_size={job.world_size})"
        )
        self._fail(job_id, job, rnd, error, code)

    def _fail(self, job_id: str, job: _Job, rnd: Round, error: RoundError, reason: str) -> None:
        rnd.error = error
        log.warning("%s", error)
        self._release(job_id, job, rnd, "failed", reason)

    def _release(self, job_id: str, job: _Job, rnd: Round, outcome: str, reason: str) -> None:
        """Wake the waiters, count the outcome, forget old rounds, report. Caller holds ``rnd.lock``."""
        rnd.accumulator = None
        rnd.done.set()
        if self._observer is not None:
            self._observer.round_finished(_report(job_id, rnd, outcome, reason))
        with self._lock:
            self.counters[f"rounds_{outcome}"] += 1
            self.counters["contributions"] += len(rnd.contributors)
            job.newest_finished_step = max(job.newest_finished_step, rnd.step)
            oldest = job.newest_finished_step - self.policy.retain_steps
            for key in [k for k, r in job.rounds.items() if r.step < oldest and r.done.is_set()]:
                del job.rounds[key]

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Refuse new jobs and rounds; rounds in flight may still complete."""
        with self._lock:
            self._closing = True

    def fail_in_flight(self, reason: str) -> int:
        """Fail every round still in flight with UNAVAILABLE (clients retry); returns how many."""
        with self._lock:
            waiting = [(job_id, job, r) for job_id, job in self._jobs.items() for r in job.rounds.values()]
        failed = 0
        for job_id, job, rnd in waiting:
            with rnd.lock:
                if not rnd.done.is_set():
                    self._fail(job_id, job, rnd, UnavailableError(f"{rnd.describe(job_id)}: {reason}"), "shutdown")
                    failed += 1
        return failed

    def in_flight(self) -> int:
        """Rounds started and not yet finished, over all jobs."""
        with self._lock:
            return sum(not r.done.is_set() for job in self._jobs.values() for r in job.rounds.values())

    def jobs(self) -> dict[str, list[int]]:
        """Job id -> joined ranks, for logs and tests."""
        with self._lock:
            return {job_id: sorted(job.joined) for job_id, job in self._jobs.items()}


def _answer(job_id: str, rnd: Round, rank: int) -> RoundResult:
    if rnd.error is not None:
        raise type(rnd.error)(str(rnd.error))
    assert rnd.result is not None
    if rank not in rnd.result.contributors:
        raise FailedPreconditionError(
            f"{rnd.describe(job_id)} closed at its deadline over ranks {list(rnd.result.contributors)} "
            f"without rank {rank}; this contribution was not counted"
        )
    return rnd.result


def _check_job_id(job_id: str) -> None:
    if not job_id or len(job_id) > MAX_JOB_ID_LENGTH:
        raise InvalidArgumentError(f"job_id={job_id[:40]!r} is invalid; expected 1..{MAX_JOB_ID_LENGTH} characters")


def _relative_error(mean: np.ndarray, encoded: QuantizedArray) -> float:
    """||decode(encoded) - mean|| / ||mean||: what re-quantizing the mean cost (0 for a zero mean)."""
    norm = float(np.linalg.norm(mean))
    return float(np.linalg.norm(decode(encoded) - mean)) / norm if norm > 0 else 0.0


def _report(job_id: str, rnd: Round, outcome: str, reason: str) -> RoundReport:
    arrivals = sorted(rnd.arrivals.items(), key=lambda item: item[1])
    # Counted as the client counts what it receives: the encoded mean's wire size.
    sent = rnd.result.mean.nbytes * len(rnd.result.contributors) if rnd.result is not None else 0
    return RoundReport(
        job_id=job_id,
        outcome=outcome,
        reason=reason,
        contributors=len(rnd.contributors),
        numel=rnd.pushed.numel,
        received_bytes=rnd.received_bytes,
        sent_bytes=sent,
        seconds=time.monotonic() - rnd.opened_at,
        straggler_seconds=arrivals[-1][1] - arrivals[-2][1] if len(arrivals) > 1 else 0.0,
        slowest_rank=arrivals[-1][0] if arrivals else -1,
        relative_error=rnd.relative_error,
    )
