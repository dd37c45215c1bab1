"""What an elastic job's start-quorum model vote does beyond its membership: to rounds in flight and waiting Joins.

The vote itself is counted with each Join by the job's ``Membership``
(``propose_model``, ``decide_model``, ``refuse_starter``). When it refuses a
starting host, that host is a lost host: the rounds holding its pushes fail
by name, and the job forms with the others, its rounds waiting for the members
training then. A Join whose model disagrees with another's waits for the vote
(the servicer's); ``changed`` tells it when to look again.
"""

from __future__ import annotations

from collections.abc import Callable

from gradq.server.budget import MemoryBudget
from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.job import Job
from gradq.server.jobs import JobTable
from gradq.server.round_closing import RoundCloser

__all__ = ["ModelVote"]


class ModelVote:
    """The round table's side of the start quorum's model vote.

    Args:
        jobs: the table's jobs.
        closer: fails the rounds that hold a refused host's push.
        budget: given back what those rounds held.
        clock: monotonic seconds (the table's).
        go_on_without: told (outside every lock) that ``job`` formed without refused starters, with why:
            announce it and finish its rounds that have every member training.
        changed: told (outside every lock) a job id whose vote may have changed (TableEvents.model_vote_changed).
    """

    def __init__(
        self,
        jobs: JobTable,
        closer: RoundCloser,
        budget: MemoryBudget,
        clock: Callable[[], float],
        go_on_without: Callable[[Job, str], None],
        changed: Callable[[str], None],
    ) -> None:
        self._jobs = jobs
        self._closer = closer
        self._budget = budget
        self._clock = clock
        self._go_on_without = go_on_without
        self._changed = changed

    def decided(self, job_id: str, member: int, incarnation: str) -> bool:
        """Whether ``member``'s Join may be answered: the job's model is decided (or nobody disagrees now).

        Raises:
            FailedPreconditionError: MODEL_MISMATCH: the start quorum agreed on another model; or the
                member's run is gone.
        """
        with self._jobs.lock:
            job = self._jobs.member(job_id, member, incarnation, self._clock(), pending_ok=True)
            return not job.members.model_undecided(member)

    def give_up(self, job_id: str, member: int, incarnation: str) -> None:
        """A Join waiting for the decision ended unanswered: the member is no candidate any more."""
        with self._jobs.lock:
            job = self._jobs.find(job_id, incarnation)
            if job is not None:
                job.members.forget_candidate(member)
        self._changed(job_id)  # the others' disagreement with it is gone

    def refused_joining(self, job_id: str) -> None:
        """A starting host was refused at its Join (the job's model was decided without it): it may let the job form."""
        self._formed_without_refused(job_id)
        self._changed(job_id)

    def refused_members(self, job: Job, refused: list[int]) -> None:
        """The vote counted with a Join refused ``refused``: fail their rounds; the job may form without them."""
        self._fail_rounds_of(job, refused)
        self._formed_without_refused(job.job_id)

    def _formed_without_refused(self, job_id: str) -> None:
        """If the job formed without its refused starters, its rounds go on with the members training.

        A refused starter is a lost host (``Membership.refuse_starter``): rounds that waited for the hosts
        the job starts with now wait for the members training, and those that have them all finish now.
        """
        with self._jobs.lock:
            job = self._jobs.current(job_id)
            formed = job is not None and job.members.elastic and job.members.formed
        if job is not None and formed:
            self._go_on_without(job, "starting hosts were refused for their model")

    def _fail_rounds_of(self, job: Job, refused: list[int]) -> None:
        """Fail the rounds in flight that hold a push of ``refused``, and forget them.

        Only members that joined before any disagreement can have pushed (a Join that meets one waits for
        the decision), so the rounds failed here wait on nobody whose model is the job's.
        """
        with self._jobs.lock:
            rounds = [rnd for rnd in job.open if rnd.contributors & set(refused)]
            reason = job.members.refused[refused[0]]
        for rnd in rounds:
            with rnd.lock:
                if not rnd.done.is_set():
                    error = FailedPreconditionError(
                        f"{rnd.describe(job.job_id)} failed: {reason}", Refusal.MODEL_MISMATCH
                    )
                    self._closer.fail(job, rnd, error, "model_refused")
                self._budget.adjust(rnd.charged, 0, job.memory)  # forgotten: the job's hosts push it afresh
                rnd.charged = 0
            with self._jobs.lock:
                if job.rounds.get((rnd.step, rnd.bucket)) is rnd:
                    del job.rounds[(rnd.step, rnd.bucket)]
