"""The round: accumulate each rank's bucket as it arrives, average, answer every waiter.

Plain Python (no grpc), so tests drive it directly. One fp32 accumulator per
round in flight; contributions are dequantized into it on arrival, so memory is
O(bucket), not O(world x bucket). Lock order: a round's lock may be taken
before the job table's, never the other way round; a job's feedback lock is
taken under a round's lock or alone, and only the budget's after it; the
budget's lock is a leaf.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gradq.qcore import QuantizedArray
from gradq.server.budget import MemoryBudget
from gradq.server.buffers import AccumulatorPool
from gradq.server.errors import (
    CancelledError,
    FailedPreconditionError,
    InvalidArgumentError,
    Refusal,
    ResourceExhaustedError,
    RoundAbortedError,
    UnavailableError,
)
from gradq.server.job import Job
from gradq.server.job_spec import JobSpec
from gradq.server.jobs import MAX_JOB_ID_LENGTH, JobTable, Retired
from gradq.server.late_hosts import LateHosts
from gradq.server.limits import ServiceLimits
from gradq.server.model_vote import ModelVote
from gradq.server.policy import PushedGrid, RoundPolicy, feeds_back
from gradq.server.reports import RoundObserver
from gradq.server.round_closing import RoundCloser
from gradq.server.round_state import MAX_PUSH_WEIGHT, Round, RoundResult, Waker, contribution_weight
from gradq.server.step_window import check_grid, check_step, contribution_digest
from gradq.server.table_events import TableEvents, Unserved

__all__ = ["JoinAnswer", "RoundTable", "RoundResult", "RoundTicket", "MAX_JOB_ID_LENGTH"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JoinAnswer:
    """What a Join got: the job's world size, members joined, this member's id and run, and whether it must catch up."""

    world_size: int
    joined: int
    rank: int
    incarnation: str
    catch_up: bool  # an elastic newcomer to a job in training: pending until it has the state
    model_undecided: bool = False  # its model disagrees with another starting host's, and no majority settled it


@dataclass(frozen=True, slots=True)
class RoundTicket:
    """A contribution admitted into its round (``admit``), for ``add``, ``watch`` and ``answer``."""

    job: Job
    round: Round
    rank: int
    weight: int = 0  # a weighted job's push: what it stands for (JoinRequest.weighted); 0 elsewhere


class RoundTable:
    """All jobs and rounds of one aggregator.

    Args:
        policy: deadlines, quorum and return scheme.
        clock: monotonic seconds; tests may pass their own.
        package: turns a finished round's result, with its job's incarnation,
            its step and bucket, into its wire answer, once per round (stored as
            ``RoundResult.packaged``, which then holds the round's only copy of
            its mean).
        observer: told about every finished round (metrics).
        limits: step window, caps and the memory budget.
        job_finished: called with a job's id once its last joined rank has left
            (``gradq serve --exit-after-jobs`` counts these).
    """

    def __init__(
        self,
        policy: RoundPolicy,
        clock: Callable[[], float] = time.monotonic,
        package: Callable[[RoundResult, str, int, int], bytes] | None = None,
        observer: RoundObserver | None = None,
        limits: ServiceLimits | None = None,
        job_finished: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.limits = limits or ServiceLimits()
        self._clock = clock
        self.jobs = JobTable(self.limits, policy.world_size)
        self.budget = MemoryBudget(self.limits.max_memory_bytes)
        self.accumulators = AccumulatorPool()
        self._closer = RoundCloser(
            policy, self.jobs, self.budget, self.accumulators, package, observer, self.outer_boundary
        )
        self.counters = self._closer.counters
        # Late pushes merged into the next round, and DiLoCo hosts behind the job's outer round.
        self.late_hosts = LateHosts(self.jobs, self.budget, self._closer, self._members_waited_less)
        self._job_finished = job_finished
        # Who is told what changes: the servicer, once it listens (``listen``).
        self._events: TableEvents = Unserved()
        # An elastic job's start-quorum model vote: its refusals' effect on rounds, and the Joins waiting for it.
        self.vote = ModelVote(
            self.jobs, self._closer, self.budget, clock, self._go_on_without_refused, self._vote_changed
        )

    def listen(self, events: TableEvents) -> None:
        """Tell ``events`` what changes from now on (the servicer listens once, before it serves)."""
        self._events = events

    def outer_boundary(self, job: Job, step: int) -> None:
        """A DiLoCo job's global state is whole before outer round ``step`` (a round closed, or a seed landed)."""
        self._events.outer_boundary(job, step)

    def _vote_changed(self, job_id: str) -> None:
        self._events.model_vote_changed(job_id)

    def _go_on_without_refused(self, job: Job, reason: str) -> None:
        self._events.membership_changed(job, "model_refused")
        self.finish_rounds_complete(job, reason)

    def _members_waited_less(self, job: Job, reason: str) -> None:
        """Members of ``job`` became pending (late, behind): announce it; finish the rounds complete without them."""
        self._events.membership_changed(job, "late")
        self.finish_rounds_complete(job, reason)

    # -- membership -------------------------------------------------------------------------

    def join(self, spec: JobSpec, peer: str = "") -> JoinAnswer:
        """Register the member ``spec`` names with the current run of its job (see ``JobTable.join``).

        A new ``incarnation`` starts a fixed job fresh; an elastic member may
        ask for ANY_RANK. ``peer`` is the calling client host. When the start
        quorum's model vote (counted by the job table with the Join) refuses
        members, their rounds in flight fail with that refusal.

        Returns:
            The job's world size, the members joined, which member and run were
            joined, and whether its model is still undecided (the servicer waits).

        Raises:
            InvalidArgumentError, FailedPreconditionError, ResourceExhaustedError,
            UnavailableError: see ``JobTable.join``.
        """
        quorum, ranks = self.policy.partial_quorum, spec.job_ranks or spec.world_size
        if quorum > ranks:
            raise FailedPreconditionError(
                f"job_ranks={ranks} is below gradq serve --partial-quorum={quorum}, which counts ranks: no round of "
                f"this job could ever close short of ranks; start the aggregator with --partial-quorum of at most "
                f"{ranks} (or 0: strict rounds), or give the job at least {quorum} ranks"
            )
        with self.jobs.lock:
            forming = (job := self.jobs.current(spec.job_id)) is not None and not job.members.formed
        try:
            joined = self.jobs.join(spec, self._clock(), peer)
        except FailedPreconditionError as error:
            if forming and error.refusal is Refusal.MODEL_MISMATCH:  # a starting host refused may let it form
                self.vote.refused_joining(spec.job_id)
            raise
        job, member, refused = joined.job, joined.rank, joined.refused
        self._retire(joined.retired)
        with self.jobs.lock:
            members = job.members
            answer = JoinAnswer(
                job.world_size,
                len(members.joined),
                member,
                job.incarnation,
                members.is_pending(member),
                members.model_undecided(member),
            )
            formed = members.formed
        if refused:
            log.warning(
                "%s: the start quorum's model refused members %s, each a lost host; the job %s (%d joined)",
                job.describe(),
                refused,
                "formed" if formed else "forms once enough hosts join",
                answer.joined,
            )
            self.vote.refused_members(job, refused)
        if members.elastic:
            self._events.model_vote_changed(job.job_id)
            self._events.membership_changed(job, "pending" if answer.catch_up else "joined")
        return answer

    def now(self) -> float:
        """The table's clock (monotonic seconds; injected in tests)."""
        return self._clock()

    def leave(self, job_id: str, rank: int, incarnation: str = "") -> None:
        """Deregister ``rank``; rounds still waiting for it close now instead of at their deadline.

        Raises:
            FailedPreconditionError: ``incarnation`` is not the job's current one.
        """
        job, retired = self.jobs.leave(job_id, rank, incarnation, self._clock())
        self._retire(retired)
        if job is not None:
            self._events.model_vote_changed(job_id)  # a candidate that left disagrees with nobody now
        if job is not None and retired and job.members.elastic:
            self._events.membership_changed(job, "rank_left")  # the last leave counts too: the job has no member now
        if job is not None and retired and self._job_finished is not None:
            self._job_finished(job_id)  # its last rank left: the job is done
        if job is None or retired:
            return
        self.member_gone(job, rank, f"rank {rank} left the job", "rank_left")

    def member_gone(self, job: Job, rank: int, reason: str, code: str) -> None:
        """A member left or was lost: a formed elastic job goes on without it, any other closes what waits on it."""
        self._events.model_vote_changed(job.job_id)
        with self.jobs.lock:
            goes_on = job.members.goes_on_without_the_gone
        if goes_on:
            self._events.membership_changed(job, code)
            self.finish_rounds_complete(job, reason)
        else:
            self.close_rounds_lacking(job, rank, reason, code)

    def finish_rounds_complete(self, job: Job, reason: str) -> None:
        """Finish every open round of ``job`` that has all the members training now; fail them all if none is."""
        with self.jobs.lock:
            waiting = list(job.open)
        for rnd in waiting:
            with rnd.lock:
                if rnd.done.is_set():
                    continue
                with self.jobs.lock:
                    complete, anyone = job.members.complete(rnd.contributors), bool(job.members.joined)
                if complete:
                    self._closer.finish(job, rnd)
                elif not anyone:
                    error = RoundAbortedError(f"{rnd.describe(job.job_id)} failed: {reason}; no member is left")
                    self._closer.fail(job, rnd, error, "no_members")

    def close_rounds_lacking(self, job: Job, rank: int, reason: str, code: str) -> None:
        """Close now, partial over a quorum or failed, every open round of ``job`` still waiting for ``rank``."""
        with self.jobs.lock:
            waiting = list(job.open)
        for rnd in waiting:
            with rnd.lock:
                if not rnd.done.is_set() and rank not in rnd.contributors:
                    self._closer.close_early(job, rnd, reason, code)

    def _retire(self, retired: list[Retired]) -> None:
        """Fail the rounds still waiting in forgotten runs and give back what they held."""
        for gone in retired:
            self._events.model_vote_changed(gone.job.job_id)  # a Join waiting in it is refused as of another run
        self._closer.retire(retired)

    # -- the round --------------------------------------------------------------------------

    def admit(
        self,
        job_id: str,
        step: int,
        bucket: int,
        rank: int,
        tensor: QuantizedArray,
        incarnation: str = "",
        weight: int = 0,
    ) -> RoundTicket:
        """A push's first half (``_admit``); in a DiLoCo job, whoever it shows behind the job's outer round catches up.

        Returns:
            The ticket of the round the push joins.

        Raises:
            What ``_admit`` raises; FailedPreconditionError (Refusal.BEHIND) for a DiLoCo push that would
            open a round older than the job's outer round: its member is pending from then on
            (``LateHosts.leave_behind``).
        """
        try:
            ticket = self._admit(job_id, step, bucket, rank, tensor, incarnation, weight)
        except FailedPreconditionError as error:
            if error.refusal is Refusal.BEHIND:
                with self.jobs.lock:  # (a member that left meanwhile is refused as such instead)
                    job = self.jobs.member(job_id, rank, incarnation, self._clock(), late_step=step)
                newest = job.outer.newest if job.outer is not None else step
                self.late_hosts.leave_behind(job, newest, {rank: step}, f"member {rank} pushed outer round {step}")
            raise
        if ticket.job.outer is not None:  # a push of a newer outer round leaves the older rounds in flight behind
            self.late_hosts.leave_behind(ticket.job, step, {}, f"member {rank} pushed outer round {step}")
        return ticket

    def _admit(
        self,
        job_id: str,
        step: int,
        bucket: int,
        rank: int,
        tensor: QuantizedArray,
        incarnation: str = "",
        weight: int = 0,
    ) -> RoundTicket:
        """A push's first half: every check that can refuse, and the round found or opened. Never decodes.

        Cheap (no pass over the payload, only the job table's lock), so the
        server runs it on its event loop: a flood of pushes that are refused
        never queues ahead of other jobs' decoding.

        Raises:
            InvalidArgumentError: numel too large, or disagreeing with the round's; a weight outside
                1..MAX_PUSH_WEIGHT in a weighted job, or one given in a job that is not.
            FailedPreconditionError: unknown job, rank or incarnation; a step
                outside the window; another grid than the bucket's.
            ResourceExhaustedError: the memory budget or the job's open rounds are used up.
            UnavailableError: the aggregator is shutting down and the round is new.
            RoundAbortedError: a fixed job's member is lost (no partial quorum).
        """
        if tensor.numel > self.policy.max_bucket_elements:
            raise InvalidArgumentError(
                f"tensor.numel={tensor.numel} is too large; this aggregator accepts buckets of up to "
                f"{self.policy.max_bucket_elements} elements (--max-bucket-elements)"
            )
        with self.jobs.lock:
            job = self.jobs.member(job_id, rank, incarnation, self._clock(), late_step=step)
            _check_weight(job, weight)
            check_grid(job, bucket, tensor, self.budget)
            rnd = job.rounds.get((step, bucket))
            if rnd is not None and self._superseded_failure(job, rnd):
                del job.rounds[(step, bucket)]
                self.budget.adjust(rnd.charged, 0, job.memory)  # a done round's charge is final
                rnd.charged = 0
                rnd = None
            if job.outer is not None:  # DiLoCo: the push must fit the job's global state (gradq.server.outer_state)
                job.outer.check_push(bucket, step, tensor.numel, rnd is None, job.describe(), self.budget, job.memory)
            loss = job.members.blocking_loss(self.policy.partial_quorum)
            if loss and (rnd is None or not rnd.done.is_set()):
                raise RoundAbortedError(
                    f"round (job={job_id!r}, step={step}, bucket={bucket}) cannot complete: rank {loss[0]} was lost "
                    f"({loss[1]}); restart the job (a new incarnation) or rejoin that rank",
                    Refusal.LOST if loss[0] == rank else Refusal.UNSPECIFIED,
                )
            if rnd is None:
                rnd = self._open_round(job, step, bucket, tensor)
            elif tensor.numel != rnd.pushed.numel:
                raise InvalidArgumentError(
                    f"tensor.numel={tensor.numel} does not match numel={rnd.pushed.numel} of "
                    f"{rnd.describe(job_id)}; every rank must send the same bucket size"
                )
        return RoundTicket(job, rnd, rank, weight)

    def add(self, ticket: RoundTicket, tensor: QuantizedArray, non_finite: bool = False) -> None:
        """A push's second half: dequantize the admitted contribution into its round, finishing it if last.

        A resend of an accepted contribution is not counted again; one whose
        content differs is refused. ``non_finite`` says the rank's bucket held
        NaN/Inf (``tensor`` then only carries its size): under the reject policy
        the round fails for every rank, under the skip policy it completes with
        a zero mean marked skipped.

        Raises:
            FailedPreconditionError: a resend whose content differs from what was counted.
        """
        job, rnd, rank = ticket.job, ticket.round, ticket.rank
        digest = contribution_digest(tensor, non_finite, ticket.weight)
        with rnd.lock:
            late = job.rules.takes_late(rnd, rank)  # gradq.server.round_rules
        if late:
            self.late_hosts.stash(job, rnd, rank, tensor, non_finite, ticket.weight)
            return
        with rnd.lock:
            self._add_locked(job, rnd, rank, tensor, non_finite, digest, ticket.weight)

    def try_add(self, ticket: RoundTicket, tensor: QuantizedArray) -> bool:
        """``add`` a finite contribution at once if that can neither wait nor finish the round; whether it did.

        For the event loop, which must not block: it gives up (returns False,
        nothing changed) when the round's lock is held, when this contribution
        would complete the round (averaging and re-encoding it take a
        millisecond or more, and the job's feedback lock), when it is a resend
        or its round is done (``add`` answers those), and where the job's round
        rules say so (``RoundRules.counts_inline``).
        The caller then runs ``add`` on a pool thread.

        Raises:
            Nothing ``add`` would not: a contribution it takes is new, so no digest can disagree.
        """
        job, rnd, rank = ticket.job, ticket.round, ticket.rank
        if not job.rules.counts_inline() or not rnd.lock.acquire(blocking=False):
            return False
        try:
            if rnd.done.is_set() or rank in rnd.contributors or self._completes(job, rnd.contributors | {rank}):
                return False
            digest = contribution_digest(tensor, False, ticket.weight)
            self._add_locked(job, rnd, rank, tensor, False, digest, ticket.weight)
            return True
        finally:
            rnd.lock.release()

    def _add_locked(
        self, job: Job, rnd: Round, rank: int, tensor: QuantizedArray, non_finite: bool, digest: int, weight: int
    ) -> None:
        """``add``'s work under ``rnd.lock``: refuse a changed resend, count a new contribution, finish if last."""
        if rank in rnd.contributors and rnd.digests.get(rank, digest) != digest:
            raise FailedPreconditionError(
                f"{rnd.describe(job.job_id)} already counted a different bucket from rank={rank}; "
                f"a resend must carry the same content (retry with the original payload)"
            )
        if not rnd.done.is_set() and rank not in rnd.contributors:
            ranks = job.members.ranks.get(rank, 1)
            counted, times = contribution_weight(ranks, weight)
            if not non_finite:
                last = self._completes(job, rnd.contributors | {rank})
                rnd.accumulate(tensor, last=last, weight=rnd.weight + counted, times=times)
            elif self.policy.non_finite == "reject":
                reason = f"rank {rank} reported NaN/Inf gradients; the policy is to reject them (--non-finite)"
                error = InvalidArgumentError(f"{rnd.describe(job.job_id)} failed: {reason}")
                self._closer.fail(job, rnd, error, "non_finite")
                return
            else:
                rnd.non_finite.add(rank)
            rnd.contributors.add(rank)
            rnd.ranks += ranks
            rnd.weight += counted
            rnd.digests[rank] = digest
            rnd.arrivals[rank] = self._clock()
            rnd.received_bytes += tensor.nbytes
            if self._completes(job, rnd.contributors):
                self._closer.finish(job, rnd)
            else:
                job.rules.counted(rnd, self._clock())

    def _completes(self, job: Job, contributors: set[int]) -> bool:
        """Whether ``contributors`` complete a round of ``job``. Caller holds the round's lock."""
        members = job.members
        if not members.elastic:
            return members.complete(contributors)  # a fixed job's members never change in a run: no lock
        with self.jobs.lock:  # an elastic job's do
            return members.complete(contributors)

    def _superseded_failure(self, job: Job, rnd: Round) -> bool:
        """A round that failed for lack of ranks which a new push of its (step, bucket) starts afresh.

        A failed round answers its failure at once to every later push of its
        (step, bucket), as a completed one answers its mean: a retry, or a rank
        that was late past the deadline (stopped, swapped out), which then
        goes on to the step the others are at instead of opening the failed
        round again and waiting a whole deadline for ranks that have moved on.
        Only a round that nothing has moved past is started afresh, one round
        timeout after its deadline: no round of a later step has been opened
        since, so it was opened too early by a stray push (it must not break
        the legitimate step when the job gets there, nor be mixed into it).
        Caller holds the job table's lock.
        """
        aborted = rnd.done.is_set() and isinstance(rnd.error, RoundAbortedError)  # done: its charge is final
        moved_past = job.newest_step > rnd.step
        return aborted and not moved_past and self._clock() >= rnd.deadline + self.policy.round_timeout_s

    def _open_round(self, job: Job, step: int, bucket: int, tensor: QuantizedArray) -> Round:
        """A new round, inside the step window and the budgets. Caller holds the job table's lock."""
        check_step(job, step, self.policy.retain_steps, self.limits.max_steps_ahead)
        if self.jobs.closing:
            raise UnavailableError("the aggregator is shutting down; no new rounds are started")
        if len(job.open) >= self.limits.max_open_rounds:
            raise ResourceExhaustedError(
                f"{job.describe()} has {len(job.open)} rounds open, its limit (--max-open-rounds="
                f"{self.limits.max_open_rounds}); finish them before starting round (step={step}, bucket={bucket})"
            )
        charge = 4 * tensor.numel  # the fp32 accumulator
        what = f"round (job={job.job_id!r}, step={step}, bucket={bucket})"
        grid = PushedGrid(tensor.scheme, tensor.bits, tensor.channel_size, tensor.numel, tensor.dtype, tensor.topk)
        residual = job.error_feedback.residual(bucket) if feeds_back(self.policy, grid) else None
        if feeds_back(self.policy, grid) and (residual is None or residual.size != tensor.numel):
            # The fp32 residual its mean will leave (--server-error-feedback), held until the job ends:
            # reserved now, so a job that invents round keys is refused instead of growing without bound.
            charge += 4 * tensor.numel
            what += " and its error-feedback residual"
        self.budget.charge(charge, what, job.memory)
        try:
            accumulator = self.accumulators.take(tensor.numel)
        except MemoryError:
            self.budget.adjust(charge, 0, job.memory)
            raise
        # Free accumulators of other sizes are resident too: rounds plus the pool stay within the budget.
        self.accumulators.trim_to(self.budget.limit - self.budget.in_use)
        rnd = Round(step, bucket, grid, self._clock() + self.policy.round_timeout_s, accumulator)
        rnd.charged = charge
        job.rounds[(step, bucket)] = rnd
        job.open.add(rnd)
        if job.first_step < 0:
            job.first_step = step
        job.newest_step = max(job.newest_step, step)
        return rnd

    def watch(self, ticket: RoundTicket, waker: Waker) -> float | None:
        """Have ``waker`` set when the ticket's round finishes; never blocks on the round's work.

        Returns:
            Seconds left to the round's deadline, or None when it is done already
            (answer at once; ``waker`` is not kept).
        """
        rnd = ticket.round
        with rnd.wakers_lock:
            if rnd.done.is_set():
                return None
            rnd.wakers.add(waker)
        return max(0.0, rnd.deadline - self._clock())

    def unwatch(self, ticket: RoundTicket, waker: Waker) -> None:
        """Forget ``waker`` (its call has its answer or stopped waiting)."""
        with ticket.round.wakers_lock:
            ticket.round.wakers.discard(waker)

    def answer(self, ticket: RoundTicket, gave_up: bool = False) -> RoundResult:
        """The ticket's answer once its wait is over: the result, or the round closed if its deadline passed.

        Args:
            ticket: from ``admit``.
            gave_up: the caller stopped waiting before the round finished (its
                client cancelled or its deadline passed). The contribution stays
                counted, so a retry is answered from the round.

        Raises:
            FailedPreconditionError: a partial round closed without this rank.
            RoundAbortedError: the round's deadline passed with ranks missing.
            UnavailableError: the aggregator shut down before the round completed.
            CancelledError: the caller gave up first.
        """
        rnd = ticket.round
        if not rnd.done.is_set():
            if gave_up:
                raise CancelledError(f"{rnd.describe(ticket.job.job_id)}: the client stopped waiting")
            self.close_if_due(ticket.job, rnd)
        return _answer(ticket.job, rnd, ticket.rank)

    def close_if_due(self, job: Job, rnd: Round) -> None:
        """Close a round whose deadline has passed (by a waiter or the sweeper)."""
        with rnd.lock:
            if not rnd.done.is_set() and self._clock() >= rnd.deadline:
                reason, code = job.rules.close_reason(rnd, self.policy.round_timeout_s)
                self._closer.close_early(job, rnd, reason, code)

    # -- lifecycle ----------------------------------------------------------------------------

    def sweep(self) -> None:
        """Close rounds past their deadline that no call waits for, and forget idle jobs (the sweeper calls this)."""
        with self.jobs.lock:
            due = [(job, rnd) for job in self.jobs.all() for rnd in job.open if self._clock() >= rnd.deadline]
        for job, rnd in due:
            self.close_if_due(job, rnd)
        self._retire(self.jobs.expire(self._clock()))
        self.accumulators.drop_idle()

    def close(self) -> None:
        """Refuse new jobs and rounds; rounds in flight may still complete."""
        with self.jobs.lock:
            self.jobs.closing = True

    def fail_in_flight(self, reason: str) -> int:
        """Fail every round still in flight with UNAVAILABLE (clients retry); returns how many."""
        with self.jobs.lock:
            waiting = [(job, rnd) for job in self.jobs.all() for rnd in job.open]
        failed = 0
        for job, rnd in waiting:
            with rnd.lock:
                if not rnd.done.is_set():
                    self._closer.fail(job, rnd, UnavailableError(f"{rnd.describe(job.job_id)}: {reason}"), "shutdown")
                    failed += 1
        return failed

    def in_flight(self) -> int:
        """Rounds started and not yet finished, over all jobs."""
        with self.jobs.lock:
            return sum(len(job.open) for job in self.jobs.all())

    def active_jobs(self) -> dict[str, list[int]]:
        """Job id -> the members training, for the stop log and for callers outside the server."""
        with self.jobs.lock:
            return {job.job_id: sorted(job.members.joined) for job in self.jobs.all()}


def _check_weight(job: Job, weight: int) -> None:
    """A weighted job's push must carry a weight in range, and another job's none. Caller holds the job table's lock.

    Raises:
        InvalidArgumentError: naming the weight, the job and what was expected.
    """
    if job.weighted and not 1 <= weight <= MAX_PUSH_WEIGHT:
        raise InvalidArgumentError(
            f"weight={weight} is invalid; expected 1..{MAX_PUSH_WEIGHT} in {job.describe()}, whose hosts weight "
            f"their pushes (JoinRequest.weighted): what this member trained on since it last pushed this key"
        )
    if weight and not job.weighted:
        raise InvalidArgumentError(
            f"weight={weight} is invalid; expected 0 in {job.describe()}, whose hosts joined without "
            f"weighted=True (its means are over ranks)"
        )


def _answer(job: Job, rnd: Round, rank: int) -> RoundResult:
    job_id = job.job_id
    if rnd.error is not None:
        raise type(rnd.error)(str(rnd.error), getattr(rnd.error, "refusal", Refusal.UNSPECIFIED))
    assert rnd.result is not None
    job.rules.answer(job_id, rnd, rank)  # gradq.server.round_rules: a late member's refusal
    if rank not in rnd.result.contributors:
        raise FailedPreconditionError(
            f"{rnd.describe(job_id)} closed at its deadline over ranks {list(rnd.result.contributors)} "
            f"without rank {rank}; this contribution was not counted"
        )
    return rnd.result
