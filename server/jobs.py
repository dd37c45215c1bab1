"""The job table: which jobs exist, which run (incarnation) of each, and when they expire.

A job is one run of a job id: a Join with another incarnation retires the
current run and starts a fresh one (new members, new step window, new rounds),
so nothing of one run is mixed into the next. Retired runs hand their rounds
back to the caller, which fails those still waiting (the round logic owns that).
Who the members of a run are, and what its rounds wait for, is
gradq.server.membership's.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from gradq.qcore import ErrorFeedback
from gradq.server.budget import MemoryAccount
from gradq.server.ended_runs import EndedRuns
from gradq.server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    Refusal,
    ResourceExhaustedError,
    UnavailableError,
)
from gradq.server.job_spec import ANY_RANK, MAX_JOB_ID_LENGTH, JobSpec, MemberRole, check_job_id
from gradq.server.limits import ServiceLimits
from gradq.server.membership import Membership
from gradq.server.outer_state import OuterState
from gradq.server.round_rules import SYNC_RULES, RoundRules, rules_for
from gradq.server.round_state import Round
from gradq.server.semi_sync import LateStash, SemiSync

__all__ = ["Job", "JobTable", "Joined", "Retired", "MAX_JOB_ID_LENGTH", "describe_incarnation"]

log = logging.getLogger(__name__)

# Earlier incarnations of a job remembered per job, so a straggler of a finished
# run cannot retire the run that replaced it by joining again.
_SUPERSEDED_KEPT = 8


def describe_incarnation(incarnation: str) -> str:
    """``incarnation='x'`` or ``no incarnation`` (the empty string), for messages."""
    return f"incarnation={incarnation[:64]!r}" if incarnation else "no incarnation"


@dataclass(eq=False, slots=True)
class Job:
    """One run of a job id: its members (see gradq.server.membership), its rounds and its step window."""

    job_id: str
    incarnation: str
    last_active: float
    memory: MemoryAccount  # its share of the memory budget
    members: Membership  # who trains, waits, left or was lost, and what a round waits for
    creator: str = ""  # the client host whose Join started it (counted against --max-jobs-per-peer)
    watches: int = 0  # Watch streams open on this run
    # (step, bucket) -> round, in flight or finished-and-retained for retries.
    rounds: dict[tuple[int, int], Round] = field(default_factory=dict)
    open: set[Round] = field(default_factory=set)  # rounds of ``rounds`` still in flight
    # Only completed rounds move it: a failed round never makes later steps stale.
    newest_completed_step: int = -1
    # Anchors the step window until a round completes (a job may resume from a checkpoint at any step).
    first_step: int = -1
    # The newest step of any round opened: a failed round of an older step is one the ranks have moved past.
    newest_step: int = -1
    # Round key (bucket) -> (scheme, bits, channel size) fixed by its first push; every later push of
    # that bucket must match, so one bucket may carry more bits than another (see step_window.check_grid).
    grids: dict[int, tuple[object, ...]] = field(default_factory=dict)
    error_feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # --server-error-feedback's residuals
    feedback_lock: threading.Lock = field(default_factory=threading.Lock)  # a leaf: one mean at a time uses them
    superseded: tuple[str, ...] = ()
    retired: bool = False  # forgotten by the table; its pushes in flight must not open rounds
    # DiLoCo: the outer step and global state the aggregator keeps (JoinRequest.outer_step); None: it only averages.
    outer: OuterState | None = None
    semi_sync: SemiSync | None = None  # JoinRequest.semi_sync; None: every round waits for every member
    rules: RoundRules = SYNC_RULES  # what decides its rounds where the round table does not (from semi_sync)
    weighted: bool = False  # JoinRequest.weighted: every push carries a weight, and means are weighted by them
    late: dict[int, LateStash] = field(default_factory=dict)  # round key -> late pushes to merge into its next round

    @property
    def world_size(self) -> int:
        """The members the job starts with."""
        return self.members.world_size

    @property
    def joined(self) -> set[int]:
        """The members training now (read it under the job table's lock)."""
        return self.members.joined

    def describe(self) -> str:
        """``job 'x' (incarnation='y')`` for messages."""
        return f"job {self.job_id!r} ({describe_incarnation(self.incarnation)})"


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
        job_id, elastic = spec.job_id, spec.elastic
        # An elastic job's member ids outgrow its starting world_size as hosts are replaced.
        self._check_world(spec.world_size, spec.job_ranks, 0 if elastic else spec.rank)
        retired: list[Retired] = []
        with self.lock:
            if self.closing:
                raise UnavailableError("the aggregator is shutting down; join another shard or retry after restart")
            job = self._jobs.get(job_id)
            self._check_not_ended(spec, job, now)
            if job is not None and job.members.elastic != elastic:
                raise FailedPreconditionError(
                    f"elastic={elastic} does not match {job.describe()}, which is "
                    f"{'elastic' if job.members.elastic else 'not elastic'}; every host of a job must agree"
                )
            incarnation = spec.incarnation
            if job is not None and elastic and not job.members.empty:
                incarnation = _elastic_run(job, spec)
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
            _check_rounds(job, spec)
            if spec.role is MemberRole.RESUMING and spec.rank in members.dropped:
                raise FailedPreconditionError(
                    f"member {spec.rank} of elastic {job.describe()} was dropped (silent past the keepalive): its "
                    f"state is stale; join as a newcomer to receive the job's",
                    Refusal.NOT_JOINED,
                )
            pending = spec.role is MemberRole.JOINING or _newcomer(job, spec)
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

    def _check_not_ended(self, spec: JobSpec, job: Job | None, now: float) -> None:
        """Refuse a host that resumes (or waits to join) a run that ended: nobody is left to form it with.

        Only an elastic host that holds the run's state (RESUMING) or was pending in it (JOINING) says it
        belongs to that run; a STARTING Join with the same incarnation starts the job afresh, as before.
        Caller holds ``lock``.

        Raises:
            FailedPreconditionError: JOB_ENDED, naming the job and its run.
        """
        if not spec.elastic or spec.role is MemberRole.STARTING:
            return
        live = job is not None and job.incarnation == spec.incarnation
        if live or not self.ended_runs.ended(spec.job_id, spec.incarnation, now):
            return
        raise FailedPreconditionError(
            f"job {spec.job_id!r} ({describe_incarnation(spec.incarnation)}) has ended: its other hosts finished "
            f"and left; member {spec.rank} has no run to rejoin (start a new run of the job to train again)",
            Refusal.JOB_ENDED,
        )

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

    def _check_world(self, world_size: int, job_ranks: int, rank: int) -> None:
        limit = self.limits.max_world_size
        if world_size < 1 or world_size > limit:
            raise InvalidArgumentError(f"world_size={world_size} is invalid; expected 1..{limit} (--max-world-size)")
        if job_ranks and not world_size <= job_ranks <= limit:
            raise InvalidArgumentError(
                f"job_ranks={job_ranks} is invalid; expected {world_size}..{limit}: at least one rank per member "
                f"(world_size={world_size}), at most --max-world-size"
            )
        total = job_ranks or world_size
        if self.fixed_world_size and total != self.fixed_world_size:
            hosts = f", {_count(world_size, 'member')} standing for them" if total != world_size else ""
            ranks = _count(total, "rank")
            raise FailedPreconditionError(
                f"configuration mismatch: this job has {ranks} (world_size from the launcher{hosts}) but "
                f"gradq serve --world-size={self.fixed_world_size}; start the aggregator with --world-size="
                f"{total} (or 0: each job's first Join decides), or launch {self.fixed_world_size} ranks"
            )
        if rank >= world_size:
            raise InvalidArgumentError(
                f"rank={rank} is out of range; expected 0..{world_size - 1} for world_size={world_size}"
            )


def _elastic_run(job: Job, spec: JobSpec) -> str:
    """The run an elastic Join into ``job``'s live run joins: the live one, unless ``spec`` resumes another.

    A member that trained in its run (RESUMING) holds that run's state. A live run that never trained
    and that no such member joined was formed by hosts without state (a shard that restarted, first
    reached by a newcomer): it yields, and the resuming run replaces it. Caller holds the lock.

    Raises:
        FailedPreconditionError: ANOTHER_RUN: the member resumes a run other than one that trained here.
    """
    if spec.role is not MemberRole.RESUMING or spec.incarnation == job.incarnation:
        return job.incarnation
    if job.newest_completed_step < 0 and not job.members.resumed:
        return spec.incarnation
    raise FailedPreconditionError(
        f"member {spec.rank} resumes {describe_incarnation(spec.incarnation)} of job {job.job_id!r}, but this "
        f"aggregator's run of it is {job.describe()}, which has trained; join it as a newcomer to receive its state",
        Refusal.ANOTHER_RUN,
    )


def _newcomer(job: Job, spec: JobSpec) -> bool:
    """Whether ``spec`` is a host without the state of ``job``'s run joining it: it is then pending (a newcomer).

    A STARTING host of another run holds nothing of a run that has trained (a round completed here, or a
    member resumed it after this shard restarted), so it may only join as a newcomer, which takes the state
    first; never as a starting member, whose pushes would count as trained ones. Caller holds the lock.

    Raises:
        FailedPreconditionError: ANOTHER_RUN: it brings a member id of the other run (ids are per run: that
            one may be a member's here, training or still on its way back), or the run is re-forming on this
            restarted shard (its members are not all back, so no id it could draw is known to be free).
    """
    trained = job.newest_completed_step >= 0 or job.members.resumed
    if not spec.elastic or spec.role is not MemberRole.STARTING or spec.incarnation == job.incarnation or not trained:
        return False
    members = job.members
    if spec.rank != ANY_RANK:
        raise FailedPreconditionError(
            f"member {spec.rank} of {describe_incarnation(spec.incarnation)} cannot join elastic {job.describe()}, "
            f"which has trained: a host that holds none of its state is no member of it (the shard that gave that "
            f"id may have restarted and started a run of its own); join again as a newcomer",
            Refusal.ANOTHER_RUN,
        )
    if not members.formed:
        raise FailedPreconditionError(
            f"elastic {job.describe()} is re-forming on this restarted aggregator: {len(members.joined)} of its "
            f"{job.world_size} starting members are back; a newcomer joins once they are (join again shortly)",
            Refusal.ANOTHER_RUN,
        )
    return True


def _check_rounds(job: Job, spec: JobSpec) -> None:
    """The run's first Join fixes the job's outer step, its rounds and its weighting; a later Join must name the same.

    Caller holds the lock.
    """
    outer_step, semi_sync = spec.outer_step, spec.semi_sync
    if job.members.empty and job.outer is None:
        job.outer = OuterState(outer_step) if outer_step is not None else None
        job.semi_sync = semi_sync
        job.rules = rules_for(semi_sync)
        job.weighted = spec.weighted
        return
    if spec.weighted != job.weighted:
        theirs = "carry weights" if job.weighted else "carry none"
        raise FailedPreconditionError(
            f"weighted={spec.weighted} does not match {job.describe()}, whose pushes {theirs}; every host of a job "
            f"must say the same"
        )
    if semi_sync != job.semi_sync:
        mine = semi_sync.describe() if semi_sync is not None else "none (synchronous)"
        theirs = job.semi_sync.describe() if job.semi_sync is not None else "none (synchronous)"
        raise FailedPreconditionError(
            f"semi_sync {mine} does not match {job.describe()}, whose rounds are {theirs}; every host of a job "
            f"must say the same"
        )
    held = job.outer.step if job.outer is not None else None
    if held != outer_step:
        mine = outer_step.describe() if outer_step is not None else "none (the aggregator only averages)"
        theirs = held.describe() if held is not None else "none (the aggregator only averages)"
        raise FailedPreconditionError(
            f"outer_step {mine} does not match {job.describe()}, whose outer step is {theirs}; every host of a "
            f"DiLoCo job must run the outer step in the same place with the same settings"
        )


def _count(number: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
