"""Late and behind hosts: a late push merged into the key's next round, and DiLoCo hosts the job's outer round passed.

Whether a push is late is the job's round rules' call (gradq.server.round_rules);
this module does what follows: the late push is dequantized into the key's late
stash (gradq.server.semi_sync), merged into the key's next round, and its
member is pending until the next outer-round boundary. A DiLoCo job whose outer
round moved past a host's (a newer seed or push) fails that host's older rounds
at once (Refusal.BEHIND) and makes it pending too, as a late host. It holds no
reference to the round table: the table hands it the job table, the budget, the
closer and what to call when members stop being waited for. Locks: a round's
lock before the job table's, as the round table takes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gradq.qcore import QuantizedArray
from gradq.server.budget import MemoryBudget
from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.job import Job
from gradq.server.jobs import JobTable
from gradq.server.round_closing import RoundCloser
from gradq.server.round_state import Round, contribution_weight
from gradq.server.semi_sync import LateStash

__all__ = ["LateHosts"]

log = logging.getLogger(__name__)


class LateHosts:
    """What becomes of late and behind hosts in one aggregator (see the module docstring).

    Args:
        jobs: the job table (its lock guards the stash and the members).
        budget: charged for each key's late stash.
        closer: fails the rounds a DiLoCo job's outer round left behind.
        members_waited_less: told (no lock held) that ``job``'s rounds wait for fewer members now, and why:
            the round table announces it and finishes the rounds that are complete without them.
    """

    def __init__(
        self,
        jobs: JobTable,
        budget: MemoryBudget,
        closer: RoundCloser,
        members_waited_less: Callable[[Job, str], None],
    ) -> None:
        self._jobs = jobs
        self._budget = budget
        self._closer = closer
        self._members_waited_less = members_waited_less

    def stash(self, job: Job, rnd: Round, rank: int, tensor: QuantizedArray, non_finite: bool, weight: int = 0) -> None:
        """A late push (the job's rules said so) goes to the key's late stash, and its member is pending.

        The rounds after do not wait for the member until the next outer-round boundary. Takes the job
        table's lock; the caller holds no round's lock.
        """
        if non_finite:
            return  # nothing to merge; the host still takes the state
        with self._jobs.lock:
            ranks = job.members.ranks.get(rank, 1)
            counted, times = contribution_weight(ranks, weight)
            stash = job.late.get(rnd.bucket)
            if stash is None:
                self._budget.charge(
                    4 * tensor.numel, f"the late pushes of key {rnd.bucket} of {job.describe()}", job.memory
                )
                job.late[rnd.bucket] = LateStash.first(tensor, ranks, rank, counted, times)
            else:
                stash.add(tensor, ranks, rank, counted, times)
            newly_late = job.members.make_late(rank, rnd.step)
        if newly_late:
            log.warning(
                "member %d of %s was late for %s: its push is merged into the next round; pending until the "
                "next outer-round boundary",
                rank,
                job.describe(),
                rnd.describe(job.job_id),
            )
            self._members_waited_less(job, f"member {rank} was late")

    def leave_behind(self, job: Job, step: int, behind: dict[int, int], reason: str) -> None:
        """DiLoCo: ``job``'s outer round is ``step`` (gradq.server.outer_state); whoever is behind it catches up.

        The job's rounds in flight of earlier outer rounds fail now (Refusal.BEHIND), not at their deadline;
        their contributors and ``behind`` (member -> the outer round it pushed) become pending, as a late
        host does: the rounds stop waiting for them, and they take the job's state at the next boundary.
        """
        with self._jobs.lock:
            older = [rnd for rnd in job.open if rnd.step < step]
        if not older and not behind:
            return
        for rnd in older:
            with rnd.lock:
                if rnd.done.is_set():
                    continue
                behind.update(dict.fromkeys(rnd.contributors, rnd.step))
                error = FailedPreconditionError(
                    f"{rnd.describe(job.job_id)} failed: {reason}, so {job.describe()} is at outer round {step}, past "
                    f"this round's outer round {rnd.step}; its hosts take the job's state at the next boundary",
                    Refusal.BEHIND,
                )
                self._closer.fail(job, rnd, error, "behind")
        with self._jobs.lock:
            moved = sorted(member for member, at in behind.items() if job.members.make_late(member, at))
        if moved:
            log.warning(
                "members %s of %s are behind its outer round %d (%s): pending until the next outer-round boundary",
                moved,
                job.describe(),
                step,
                reason,
            )
            self._members_waited_less(job, f"members {moved} are behind outer round {step}")
