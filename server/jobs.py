"""The job table: which jobs exist, which run (incarnation) of each, and when they expire.

A job is one run of a job id: a Join with another incarnation retires the
current run and starts a fresh one (new members, new step window, new rounds),
so nothing of one run is mixed into the next. Retired runs hand their rounds
back to the caller, which fails those still waiting (the round logic owns that).
What one run holds is gradq.server.job's; who its members are, and what its
rounds wait for, gradq.server.membership's; which run an elastic host's Join
belongs to, gradq.server.elastic_runs'.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

from gradq.server.budget import MemoryAccount
from gradq.server.elastic_runs import check_not_ended, is_newcomer, run_to_join
from gradq.server.ended_runs import EndedRuns
from gradq.server.errors import FailedPreconditionError, Refusal, ResourceExhaustedError, UnavailableError
from gradq.server.job import Job, describe_incarnation
from gradq.server.job_spec import MAX_JOB_ID_LENGTH, JobSpec, MemberRole, check_job_id
from gradq.server.limits import ServiceLimits
from gradq.server.membership import Membership

__all__ = ["JobTable", "Joined", "Retired", "MAX_JOB_ID_LENGTH"]

log = logging.getLogger(__name__)

# Earlier incarnations of a job remembered per job, so a straggler of a finished
# run cannot retire the run that replaced it by joining again.
_SUPERSEDED_KEPT = 8


@dataclass(frozen=True, slots=True)
class Retired:
    """A run the table forgot, and why: the caller fails its rounds still waiting."""

    job: Job
    reason: str
    refusal: Refusal = Refusal.UNSPECIFIED  # what its waiters' failure tells their clients


@dataclass(frozen=True, slots=True)
class Joined:
    """What a Join did to the table: the run joined, the runs it retired, the member id, and whom the vote refused."""

    job: Job
    retired: list[Retired]  # runs forgotten by it (a superseded incarnation): the caller fails their rounds
    rank: int  # the member id joined
    # Members the start quorum's model vote refused with this Join (Membership.decide_model): their rounds in
    # flight must fail; their next calls are refused by name.
    refused: list[int]


class JobTable:
    """The jobs of one aggregator. ``lock`` also guards every job's ``rounds`` dict.

    Args:
        limits: caps on jobs and world size, and the idle timeout.
        fixed_world_size: the operator's --world-size (0: each job's first Join decides).
    """

    def __init__(self, limits: ServiceLimits, fixed_world_size: int = 0) -> None:
        self.limits = limits
        self.fixed_world_size = fixed_world_size
        self.lock = threading.Lock()
        self.closing = False
        self._jobs: dict[str, Job] = {}
        self._started_by: Counter[str] = Counter()  # client host -> jobs it started that are known
        # (job id, incarnation) -> when the run ended: every member left with a Leave (see ``ended``).
        self.ended_runs = EndedRuns(limits.job_idle_timeout_s)

    def join(self, spec: JobSpec, now: float, peer: str = "") -> Joined:
        """Register the member ``spec`` names with the current run of its job; idempotent, so it may rejoin.

        ``peer`` is the calling client host; a Join that starts a job counts
        against that host's --max-jobs-per-peer until the job is forgotten.
        ``spec.job_ranks`` is what --world-size is checked against. An elastic
        Join into a live run adopts its incarnation, and a newcomer to a formed
        job is pending until it has received the state (see
        gradq.server.membership), unless it resumes the run it trained in
        (``MemberRole.RESUMING``): a run formed by hosts without state yields to
        it, so a restarted shard serves the run the hosts hold, not the first
        host to dial. The run's first Join fixes the outer step and semi-sync
        rounds; its start quorum fixes the model: the vote is counted with each Join, under the lock
        that places the member (gradq.server.membership).

        Returns:
            The job, the runs retired by this Join (a superseded incarnation), the member id joined, and
            the members the model vote refused with it.

        Raises:
            InvalidArgumentError: bad job id, world size, job ranks, rank or ranks.
            FailedPreconditionError: --world-size, world size, job ranks, the cap, the model or a member's
                ranks disagree, the incarnation was superseded or is another run, or an elastic job is at its cap.
            ResourceExhaustedError: --max-jobs jobs exist already, or ``peer`` has
                started --max-jobs-per-peer of them.
            UnavailableError: the aggregator is shutting down.
        """
        spec.check(self.limits.max_world_size)
        self._check_fixed_world(spec)
        job_id, elastic = spec.job_id, spec.elastic
        retired: list[Retired] = []
        with self.lock:
            if self.closing:
                raise UnavailableError("the aggregator is shutting down; join another shard or retry after restart")
            job = self._jobs.get(job_id)
            check_not_ended(self.ended_runs, spec, job, now)
            if job is not None and job.members.elastic != elastic:
                raise FailedPreconditionError(
                    f"elastic={elastic} does not match {job.describe()}, which is "
                    f"{'elastic' if job.members.elastic else 'not elastic'}; every host of a job must agree"
                )
            incarnation = spec.incarnation
            if job is not None and elastic and not job.members.empty:
                incarnation = run_to_join(job, spec)
            if job is not None and job.incarnation != incarnation:
                if incarnation in job.superseded:
                    raise FailedPreconditionError(
                        f"{describe_incarnation(incarnation)} of job {job_id!r} was superseded by "
                        f"{describe_incarnation(job.incarnation)}; a finished run cannot rejoin",
                        Refusal.ANOTHER_RUN,
                    )
                reason = f"superseded: {job.describe()} was restarted as {describe_incarnation(incarnation)}"
                if elastic and not job.members.empty:
                    reason = (
                        f"{job.describe()} had not trained when hosts of {describe_incarnation(incarnation)}, which "
                        f"hold the job's state, came back to this aggregator (it restarted): their run is the job's; "
                        f"join it as a newcomer"
                    )
                retired.append(self._forget(job, reason, Refusal.ANOTHER_RUN))
                superseded = (*job.superseded, job.incarnation)[-_SUPERSEDED_KEPT:]
                # A restart keeps the job's slot with the host that started it: no host's count moves.
                job = self._jobs[job_id] = self._new_job(spec, incarnation, now, superseded, job.creator)
            elif job is None:
                if len(self._jobs) >= self.limits.max_jobs:
                    raise ResourceExhaustedError(
                        f"job {job_id!r} cannot start: this aggregator holds {len(self._jobs)} jobs, its limit "
                        f"(--max-jobs={self.limits.max_jobs}); idle jobs expire after --job-idle-timeout"
                    )
                if self._started_by[peer] >= self.limits.max_jobs_per_peer:
                    raise ResourceExhaustedError(
                        f"job {job_id[:64]!r} cannot start: client {peer or 'unknown'} has started "
                        f"{self._started_by[peer]} jobs this aggregator still holds, its limit "
                        f"(--max-jobs-per-peer={self.limits.max_jobs_per_peer}); idle jobs expire after "
                        f"--job-idle-timeout"
                    )
                job = self._jobs[job_id] = self._new_job(spec, incarnation, now, (), peer)
            members = job.members
            members.check_join(spec.world_size, spec.job_ranks, spec.ranks, job.describe, spec.max_members)
            self._check_model(job, spec)
            job.agree_on_rounds(spec)
            if spec.role is MemberRole.RESUMING and spec.rank in members.dropped:
                raise FailedPreconditionError(
                    f"member {spec.rank} of elastic {job.describe()} was dropped (silent past the keepalive): its "
                    f"state is stale; join as a newcomer to receive the job's",
                    Refusal.NOT_JOINED,
                )
            pending = spec.role is MemberRole.JOINING or is_newcomer(job, spec)
            if spec.role is MemberRole.RESUMING and spec.training_members and not members.formed:
                members.reform_at = min(members.reform_at or spec.training_members, spec.training_members)
            rank, rejoined = members.place(
                spec.rank, spec.ranks, self.limits.max_world_size, job.describe, pending, spec.model_signature
            )
            members.resumed = members.resumed or spec.role is MemberRole.RESUMING
            refused = members.decide_model(job.describe)
            job.last_active = now
            joined = len(members.joined)
            pending = members.is_pending(rank)
        cap = f", at most {members.max_members}" if members.max_members else ""
        log.info(
            "%s %s %d to %s (%d joined; it starts with %d%s%s)",
            "rejoin" if rejoined else "join",
            "pending member" if pending else "rank",
            rank,
            job.describe(),
            joined,
            spec.world_size,
            cap,
            f"; {spec.role.name.lower()}" if elastic else "",
        )
        return Joined(job, retired, rank, refused)

    def member(
        self, job_id: str, rank: int, incarnation: str, now: float, pending_ok: bool = False, late_step: int = -1
    ) -> Job:
        """The current run of ``job_id``, which ``rank`` has joined under ``incarnation``. Caller holds ``lock``.

        Args:
            pending_ok: accept an elastic member still waiting for the state (it may watch and fetch, not push).
            late_step: accept a pending member late for this step (semi-synchronous: its pushes are merged).

        Raises:
            FailedPreconditionError: unknown job, another incarnation, or a rank that has not joined.
        """
        check_job_id(job_id)  # before it is quoted: a refusal must not cost what a long id would
        job = self._jobs.get(job_id)
        if job is None:
            raise FailedPreconditionError(f"job {job_id!r} has no joined ranks; call Join first", Refusal.UNKNOWN_JOB)
        if job.incarnation != incarnation:
            raise FailedPreconditionError(
                f"{describe_incarnation(incarnation)} does not match the current run of job {job_id!r}, "
                f"{describe_incarnation(job.incarnation)}; Join with the current incarnation (a new one starts fresh)",
                Refusal.ANOTHER_RUN,
            )
        members = job.members
        if rank in members.refused:
            raise FailedPreconditionError(members.refused[rank], Refusal.MODEL_MISMATCH)
        late = late_step >= 0 and members.late.get(rank) == late_step  # a late member's other pushes
        if members.is_pending(rank) and not pending_ok and not late:
            raise FailedPreconditionError(
                f"member {rank} of elastic {job.describe()} is pending: it trains from the step at which a "
                f"live member sends it the state (FetchState), not before",
                Refusal.PENDING,
            )
        if not members.holds(rank, pending_ok=True):
            raise FailedPreconditionError(
                f"rank={rank} has not joined {job.describe()} ({len(members.joined)} of {job.world_size} ranks "
                f"joined); call Join first",
                Refusal.NOT_JOINED,
            )
        job.last_active = now
        return job

    def current(self, job_id: str) -> Job | None:
        """The current run of ``job_id``, whichever it is, else None. Caller holds ``lock``."""
        return self._jobs.get(job_id)

    def find(self, job_id: str, incarnation: str) -> Job | None:
        """The current run of ``job_id`` if it is ``incarnation``, else None. Caller holds ``lock``."""
        job = self._jobs.get(job_id)
        return job if job is not None and job.incarnation == incarnation else None

    def leave(self, job_id: str, rank: int, incarnation: str, now: float) -> tuple[Job | None, list[Retired]]:
        """Deregister ``rank``; the run is forgotten (retired) when its last rank leaves.

        Returns:
            (the job, or None when the rank was not a member; the runs retired).

        Raises:
            FailedPreconditionError: the incarnation is not the job's current one.
        """
        with self.lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None, []
            if job.incarnation != incarnation:
                self.member(job_id, rank, incarnation, now)  # raises, naming both incarnations
            if not job.members.remove(rank):
                return None, []
            job.last_active = now
            retired = [self._forget(job, f"every rank left {job.describe()}")] if job.members.empty else []
            if retired:
                self.ended_runs.remember(job.job_id, job.incarnation, now)
        log.info("leave rank %d from %s", rank, job.describe())
        return job, retired

    def expire(self, now: float) -> list[Retired]:
        """Forget jobs idle for --job-idle-timeout; returns them so their rounds can be failed."""
        timeout = self.limits.job_idle_timeout_s
        with self.lock:
            idle = [job for job in self._jobs.values() if now - job.last_active > timeout]
            retired = [self._forget(job, f"{job.describe()} was idle for more than {timeout:g} s") for job in idle]
        for gone in retired:
            log.info("expired %s", gone.reason)
        return retired

    def all(self) -> list[Job]:
        """Every current job. Caller holds ``lock``."""
        return list(self._jobs.values())

    def _check_model(self, job: Job, spec: JobSpec) -> None:
        """Refuse a host whose model is not the job's; while an elastic job forms, a starting one is lost to it.

        Caller holds ``lock``.

        Raises:
            FailedPreconditionError: MODEL_MISMATCH, saying whether the job forms without this host.
        """
        members = job.members
        try:
            members.check_model(spec.model_signature, job.describe)
        except FailedPreconditionError as error:
            if spec.role is not MemberRole.STARTING or not members.elastic or members.formed:
                raise
            reason = (
                f"{error}; this host is refused and elastic {job.describe()} forms without it, with the hosts "
                f"that agree, as if it had been lost"
            )
            member = members.refuse_starter(spec.rank, reason, self.limits.max_world_size, job.describe)
            if member is None:
                raise
            log.warning(
                "refused starting member %d of %s for its model: the job forms without it (%d joined; %s)",
                member,
                job.describe(),
                len(members.joined),
                "formed" if members.formed else "still forming",
            )
            raise FailedPreconditionError(reason, Refusal.MODEL_MISMATCH) from None

    def _new_job(self, spec: JobSpec, incarnation: str, now: float, superseded: tuple[str, ...], peer: str) -> Job:
        job_id, world_size, job_ranks = spec.job_id, spec.world_size, spec.job_ranks
        self.ended_runs.forget(job_id, incarnation)  # a new run under that incarnation has not ended
        members = Membership(world_size, job_ranks or world_size, job_ranks > 0, spec.elastic, spec.max_members)
        account = MemoryAccount(
            f"job {job_id!r} ({describe_incarnation(incarnation)})", self.limits.max_job_memory_bytes
        )
        self._started_by[peer] += 1
        return Job(job_id, incarnation, now, account, members, creator=peer, superseded=superseded)

    def _forget(self, job: Job, reason: str, refusal: Refusal = Refusal.UNSPECIFIED) -> Retired:
        job.retired = True
        del self._jobs[job.job_id]
        self._started_by[job.creator] -= 1
        if not self._started_by[job.creator]:
            del self._started_by[job.creator]
        return Retired(job, reason, refusal)

    def _check_fixed_world(self, spec: JobSpec) -> None:
        """Refuse a job whose ranks in all are not the operator's --world-size (when one was given)."""
        total = spec.job_ranks or spec.world_size
        if not self.fixed_world_size or total == self.fixed_world_size:
            return
        hosts = f", {_count(spec.world_size, 'member')} standing for them" if total != spec.world_size else ""
        raise FailedPreconditionError(
            f"configuration mismatch: this job has {_count(total, 'rank')} (world_size from the launcher{hosts}) but "
            f"gradq serve --world-size={self.fixed_world_size}; start the aggregator with --world-size="
            f"{total} (or 0: each job's first Join decides), or launch {self.fixed_world_size} ranks"
        )


def _count(number: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
