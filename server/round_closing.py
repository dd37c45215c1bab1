"""Closing a round: average and re-encode it, or fail it; then wake its waiters, count it and forget old rounds.

Every method but ``retire`` is called with the round's lock held; it takes the job table's
lock after it (the table's lock order), the job's feedback lock (server error
feedback) and the budget's, a leaf.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from gradq.qcore import QuantizedArray, decode, encode
from gradq.server.budget import MemoryBudget
from gradq.server.buffers import AccumulatorPool
from gradq.server.errors import InvalidArgumentError, RoundAbortedError, RoundError
from gradq.server.job import Job
from gradq.server.jobs import JobTable, Retired
from gradq.server.policy import RoundPolicy, feeds_back, return_config_for
from gradq.server.reports import RoundObserver
from gradq.server.round_report import relative_error, round_report
from gradq.server.round_state import Round, RoundResult
from gradq.server.step_window import GRID_ENTRY_BYTES

__all__ = ["RoundCloser"]

log = logging.getLogger(__name__)


class RoundCloser:
    """Finishes and fails rounds for a RoundTable.

    Args:
        policy: quorum and return scheme.
        jobs: the job table (its lock guards every job's rounds).
        budget: charged for accumulators, then for retained means.
        accumulators: where a finished round's accumulator goes for the next round.
        package: turns a result into its wire answer, once per round, given the round's job
            incarnation, step and bucket (the answer names its round, so all its waiters share it).
        observer: told about every finished round (metrics).
        outer_boundary: told when a DiLoCo job's global state on the aggregator
            is whole before an outer round (under the round's lock; must not block).
    """

    def __init__(
        self,
        policy: RoundPolicy,
        jobs: JobTable,
        budget: MemoryBudget,
        accumulators: AccumulatorPool,
        package: Callable[[RoundResult, str, int, int], bytes] | None,
        observer: RoundObserver | None,
        outer_boundary: Callable[[Job, int], None] = lambda job, step: None,
    ) -> None:
        self.policy = policy
        self._jobs = jobs
        self._budget = budget
        self._accumulators = accumulators
        self._package = package
        self._observer = observer
        self._outer_boundary = outer_boundary
        self.counters = {
            "rounds_completed": 0,
            "rounds_partial": 0,
            "rounds_skipped": 0,
            "rounds_failed": 0,
            "contributions": 0,
        }

    def finish(self, job: Job, rnd: Round, missing: tuple[int, ...] = (), reason: str = "") -> None:
        """Average, re-encode and release the waiters. Caller holds ``rnd.lock``."""
        mean = rnd.mean()
        if job.late and not rnd.non_finite:
            with self._jobs.lock:
                stash = job.late.pop(rnd.bucket, None)
            if stash is not None and stash.total.size == mean.size:
                # Semi-synchronous: the late pushes of this key count as the members' they are.
                rnd.weight = stash.merge_into(mean, rnd.weight)
                rnd.ranks += stash.ranks
                log.info("%s merged the late pushes of members %s", rnd.describe(job.job_id), sorted(stash.members))
            if stash is not None:
                self._budget.adjust(stash.nbytes, 0, job.memory)
        if rnd.non_finite:
            log.warning("%s skipped: ranks %s reported NaN/Inf", rnd.describe(job.job_id), sorted(rnd.non_finite))
        config = return_config_for(self.policy, rnd.pushed)
        encoded: QuantizedArray | None = None
        if feeds_back(self.policy, rnd.pushed):
            # One mean of the job at a time updates its residuals, and what they hold is charged to
            # it (a round reserved its bucket's residual when it opened): held until the job ends.
            with job.feedback_lock:
                held = _residual_bytes(job, rnd.bucket)
                with contextlib.suppress(ValueError):
                    encoded = job.error_feedback.encode(rnd.bucket, mean, config)
                self._budget.adjust(held, _residual_bytes(job, rnd.bucket), job.memory)
        else:
            with contextlib.suppress(ValueError):
                encoded = encode(mean, config, dtype=rnd.pushed.dtype)
        if encoded is None:
            error = InvalidArgumentError(
                f"{rnd.describe(job.job_id)}: the mean is not finite (contributions overflow float32)"
            )
            self.fail(job, rnd, error, "overflow")
            return
        if job.outer is not None and job.outer.advance(rnd.bucket, rnd.step, decode(encoded), job.describe()):
            # The aggregator's copy of the global state took the mean every member receives, as they will.
            self._outer_boundary(job, rnd.step + 1)
        if self._observer is not None:
            rnd.relative_error = relative_error(mean, encoded)
        result = RoundResult(
            encoded, tuple(sorted(rnd.contributors)), missing, ranks=rnd.ranks, skipped=bool(rnd.non_finite)
        )
        # Packaged, the wire form is the one copy the round keeps of its mean (for W waiters and retries).
        if self._package is not None:
            packaged = self._package(result, job.incarnation, rnd.step, rnd.bucket)
            rnd.result = replace(result, encoded=None, packaged=packaged)
        else:
            rnd.result = result
        del encoded, result
        log.debug("%s complete over %d ranks", rnd.describe(job.job_id), len(rnd.contributors))
        outcome = "skipped" if rnd.non_finite else "partial" if missing else "completed"
        self._release(job, rnd, outcome, reason)

    def close_early(self, job: Job, rnd: Round, reason: str, code: str) -> None:
        """Close a round that lacks ranks: partial over a quorum, else fail. Caller holds ``rnd.lock``."""
        with self._jobs.lock:  # an elastic job's members change under it
            missing = job.members.missing(rnd.contributors)
            quorum, in_ranks = job.rules.quorum(self.policy.partial_quorum)  # gradq.server.round_rules
            quorum_met = job.members.quorum_met(rnd.contributors, quorum, in_ranks=in_ranks)
            forming = job.members.elastic and not job.members.formed
            joined = len(job.members.joined)
        if quorum_met:
            log.warning(
                "%s closed partial (%s): averaged ranks %s, missing ranks %s",
                rnd.describe(job.job_id),
                reason,
                sorted(rnd.contributors),
                list(missing),
            )
            self.finish(job, rnd, missing, code)
            return
        if forming:  # no member is missing: hosts the job starts with have not joined yet
            error = RoundAbortedError(
                f"{rnd.describe(job.job_id)} failed: {reason} before the elastic job formed: {joined} of the "
                f"{job.members.world_size} hosts it starts with (elastic_hosts) have joined; have "
                f"{sorted(rnd.contributors)}"
            )
        else:
            error = RoundAbortedError(
                f"{rnd.describe(job.job_id)} failed: {reason} with ranks {list(missing)} missing (have "
                f"{sorted(rnd.contributors)} of the members {sorted({*rnd.contributors, *missing})} it waited for)"
            )
        self.fail(job, rnd, error, code)

    def fail(self, job: Job, rnd: Round, error: RoundError, reason: str) -> None:
        """Fail the round for every waiter with ``error`` (``reason`` labels it in metrics); holds ``rnd.lock``."""
        rnd.error = error
        log.warning("%s", error)
        self._release(job, rnd, "failed", reason)

    def retire(self, retired: list[Retired]) -> None:
        """Fail the rounds still waiting in forgotten runs and give back all they held: rounds, error-feedback
        residuals, DiLoCo's global state, late pushes and grids. Called with no lock held."""
        for gone in retired:
            job = gone.job
            with self._jobs.lock:
                rounds = list(job.rounds.values())
                job.rounds.clear()
            for rnd in rounds:
                with rnd.lock:
                    if not rnd.done.is_set():
                        error = RoundAbortedError(f"{rnd.describe(job.job_id)} failed: {gone.reason}", gone.refusal)
                        self.fail(job, rnd, error, "retired")
                    self._budget.adjust(rnd.charged, 0, job.memory)
                    rnd.charged = 0
            with job.feedback_lock:  # its rounds are all done: no mean changes its residuals any more
                residuals = job.error_feedback
                held = sum(_nbytes(residuals.residual(key)) for key in list(residuals.keys()))
                residuals.reset()
            if job.outer is not None:
                held += job.outer.forget()
            with self._jobs.lock:
                held += sum(stash.nbytes for stash in job.late.values())
                job.late.clear()
                held += GRID_ENTRY_BYTES * len(job.grids)
                job.grids.clear()
            self._budget.adjust(held, 0, job.memory)

    def _release(self, job: Job, rnd: Round, outcome: str, reason: str) -> None:
        """Wake the waiters, count the outcome, forget old rounds, report. Caller holds ``rnd.lock``."""
        # Kept for retries and late pushes: the mean once, or what a failure's record holds.
        retained = rnd.result.retained_bytes if rnd.result is not None else rnd.failure_bytes
        self._budget.adjust(rnd.charged, retained, job.memory)
        rnd.charged = retained
        if rnd.accumulator is not None:
            # Nothing else refers to it: the mean was encoded into arrays of its own. Its pages
            # stay resident in the pool, so the pool gives way to keep rounds plus it in the budget.
            self._accumulators.give(rnd.accumulator)
            rnd.accumulator = None
            self._accumulators.trim_to(self._budget.limit - self._budget.in_use)
        rnd.done.set()
        with rnd.wakers_lock:  # after done is set, so a call that looks later sees it and does not wait
            wakers = list(rnd.wakers)
        for wake in wakers:
            wake.set()
        if self._observer is not None:
            self._observer.round_finished(round_report(job.job_id, rnd, outcome, reason))
        dropped: list[Round] = []
        with self._jobs.lock:
            self.counters[f"rounds_{outcome}"] += 1
            self.counters["contributions"] += len(rnd.contributors)
            job.open.discard(rnd)
            if rnd.result is not None:
                job.newest_completed_step = max(job.newest_completed_step, rnd.step)
            oldest = job.newest_completed_step - self.policy.retain_steps
            for key in [k for k, r in job.rounds.items() if r.step < oldest and r.done.is_set()]:
                dropped.append(job.rounds.pop(key))
        if rnd.error is not None:
            rnd.forget_ranks()  # reported and counted: its error answers every later push
        for old in dropped:  # this round among them when its step is already below the window
            # Its lock is not needed: a done round's charge is final (this one's lock is held).
            self._budget.adjust(old.charged, 0, job.memory)
            old.charged = 0


def _residual_bytes(job: Job, bucket: int) -> int:
    """Bytes of the server error-feedback residual ``job`` holds for ``bucket`` (0 without one)."""
    residual = job.error_feedback.residual(bucket)
    return residual.nbytes if residual is not None else 0


def _nbytes(array: np.ndarray | None) -> int:
    return array.nbytes if array is not None else 0
