"""Which run of an elastic job a host's Join belongs to, or why it belongs to none.

An elastic host says what it holds with its role (gradq.server.job_spec's
``MemberRole``): nothing (STARTING), the state it was waiting for (JOINING),
or the state of a run it trained in (RESUMING). The run it joins follows from
that and from what this aggregator holds of the job: a run that ended has
nobody to form with; a live run formed by hosts without state (a shard that
restarted, first reached by a newcomer) yields to a host that resumes the
run it trained in; a host without state joins a run that has trained only as
a newcomer. The job table (gradq.server.jobs) asks here under its lock.
"""

from __future__ import annotations

from gradq.server.ended_runs import EndedRuns
from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.job import Job, describe_incarnation
from gradq.server.job_spec import ANY_RANK, JobSpec, MemberRole

__all__ = ["check_not_ended", "is_newcomer", "run_to_join"]


def check_not_ended(ended_runs: EndedRuns, spec: JobSpec, job: Job | None, now: float) -> None:
    """Refuse a host that resumes (or waits to join) a run that ended: nobody is left to form it with.

    Only an elastic host that holds the run's state (RESUMING) or was pending in it (JOINING) says it
    belongs to that run; a STARTING Join with the same incarnation starts the job afresh.

    Args:
        ended_runs: the runs every member left with a Leave.
        job: the job's current run on this aggregator, if any.

    Raises:
        FailedPreconditionError: JOB_ENDED, naming the job and its run.
    """
    if not spec.elastic or spec.role is MemberRole.STARTING:
        return
    live = job is not None and job.incarnation == spec.incarnation
    if live or not ended_runs.ended(spec.job_id, spec.incarnation, now):
        return
    raise FailedPreconditionError(
        f"job {spec.job_id!r} ({describe_incarnation(spec.incarnation)}) has ended: its other hosts finished "
        f"and left; member {spec.rank} has no run to rejoin (start a new run of the job to train again)",
        Refusal.JOB_ENDED,
    )


def run_to_join(job: Job, spec: JobSpec) -> str:
    """The run an elastic Join into ``job``'s live run joins: the live one, unless ``spec`` resumes another.

    A member that trained in its run (RESUMING) holds that run's state. A live run that never trained
    and that no such member joined was formed by hosts without state: it yields, and the resuming run
    replaces it.

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


def is_newcomer(job: Job, spec: JobSpec) -> bool:
    """Whether ``spec`` is a host without the state of ``job``'s run joining it: it is then pending (a newcomer).

    A STARTING host of another run holds nothing of a run that has trained (a round completed here, or a
    member resumed it after this shard restarted), so it may only join as a newcomer, which takes the state
    first; never as a starting member, whose pushes would count as trained ones.

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
