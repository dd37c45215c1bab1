"""The semi-synchronous rules of a round: the grace after a quorum, late pushes, and hosts behind the job.

Where gradq.server.semi_sync holds the settings and the late stash, this
module holds what the round table does with them: a round that a quorum of
members has pushed waits ``grace_s`` more (the sweeper closes it then); a push
to a round that closed without its member is late, is merged into the key's
next round and makes its member pending until the next outer-round boundary;
and a DiLoCo job whose outer round moved past a host's (a newer seed or push)
fails that host's older rounds at once (Refusal.BEHIND) and makes it pending
too, as a late host. Locks: a round's lock before the job table's, as the round
table takes them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gradq.qcore import QuantizedArray
from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.jobs import Job
from gradq.server.round_state import Round, contribution_weight
from gradq.server.semi_sync import LateStash

if TYPE_CHECKING:
    from gradq.server.rounds import RoundTable

__all__ = ["LateHosts"]

log = logging.getLogger(__name__)


class LateHosts:
    """The semi-synchronous rules of one round table (see the module docstring)."""

    def __init__(self, table: RoundTable) -> None:
        self._table = table

    def start_grace(self, job: Job, rnd: Round) -> None:
        """Semi-synchronous: once a quorum has pushed, the round waits ``grace_s`` more. Holds ``rnd.lock``."""
        semi_sync = job.semi_sync
        assert semi_sync is not None
        if not rnd.graced and len(rnd.contributors) >= semi_sync.quorum:
            rnd.graced = True
            rnd.deadline = min(rnd.deadline, self._table.now() + semi_sync.grace_s)  # the sweeper closes it then

    def merge(self, job: Job, rnd: Round, rank: int, tensor: QuantizedArray, non_finite: bool, weight: int = 0) -> bool:
        """Semi-synchronous: a push to a round closed without ``rank`` goes to the key's late stash.

        The member becomes pending (the rounds after do not wait for it) until
        the next outer-round boundary. Returns whether the push was late.
        """
        with rnd.lock:
            result = rnd.result
            if not rnd.done.is_set() or result is None or rank in result.contributors:
                return False
            rnd.late.add(rank)  # answered: merged, fetch the state
        if non_finite:
            return True  # nothing to merge; the host still takes the state
        with self._table.jobs.lock:
            ranks = job.members.ranks.get(rank, 1)
            counted, times = contribution_weight(ranks, weight)
            stash = job.late.get(rnd.bucket)
            if stash is None:
                self._table.budget.charge(
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
            self._table.membership_changed(job, "late")
            self._table.finish_rounds_complete(job, f"member {rank} was late")
        return True

    def leave_behind(self, job: Job, step: int, behind: dict[int, int], reason: str) -> None:
        """DiLoCo: ``job``'s outer round is ``step`` (gradq.server.outer_state); whoever is behind it catches up.

        The job's rounds in flight of earlier outer rounds fail now (Refusal.BEHIND), not at their deadline;
        their contributors and ``behind`` (member -> the outer round it pushed) become pending, as a late
        host does: the rounds stop waiting for them, and they take the job's state at the next boundary.
        """
        with self._table.jobs.lock:
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
                self._table.closer.fail(job, rnd, error, "behind")
        with self._table.jobs.lock:
            moved = sorted(member for member, at in behind.items() if job.members.make_late(member, at))
        if moved:
            log.warning(
                "members %s of %s are behind its outer round %d (%s): pending until the next outer-round boundary",
                moved,
                job.describe(),
                step,
                reason,
            )
            self._table.membership_changed(job, "late")
            self._table.finish_rounds_complete(job, f"members {moved} are behind outer round {step}")
