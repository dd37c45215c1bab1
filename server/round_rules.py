"""The rules that decide one job's rounds, behind one interface the round table calls at admit, add, close and answer.

As a Flower ``Strategy`` decides a federated round, a ``RoundRules`` object
decides, for the round table, what the table itself leaves open: whether a
push may be counted on the event loop, whether a push to a round that closed
without its member is late (its contribution then goes to the key's late stash,
gradq.server.late_hosts), what a counted contribution changes in its round's
deadline, what quorum a round short of members may close on, why a round due
closes, and what a member that was late is answered. The table holds no rule
of its own on these points, so a new kind of round is a new rules class.

Two kinds exist: ``SyncRules`` (every round waits for every member, a partial
quorum of ranks aside) and ``SemiSyncRules`` (JoinRequest.semi_sync: a round
closes ``grace_s`` after a quorum of hosts has pushed, and a late push is merged
into the next round). Each is plain and holds only its settings; the time a
rule needs is passed in (the table's clock), so tests drive them directly.
Every method that reads or writes a round is called with that round's lock held.
"""

from __future__ import annotations

from typing import Protocol

from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.round_state import Round
from gradq.server.semi_sync import SemiSync

__all__ = ["RoundRules", "SyncRules", "SemiSyncRules", "SYNC_RULES", "rules_for"]


class RoundRules(Protocol):
    """What decides a job's rounds where the round table does not (see the module docstring)."""

    def counts_inline(self) -> bool:
        """Admit/add: whether a contribution may be counted on the event loop (``RoundTable.try_add``)."""
        ...

    def takes_late(self, rnd: Round, rank: int) -> bool:
        """Add: whether a push by ``rank`` to ``rnd`` is late (``rnd`` closed without it); marks it so if it is."""
        ...

    def counted(self, rnd: Round, now: float) -> None:
        """Add: a contribution was counted and ``rnd`` still waits; the rules may bring its deadline forward."""
        ...

    def quorum(self, partial_quorum: int) -> tuple[int, bool]:
        """Close: the quorum a round short of members may close on (0: none), and whether it counts ranks."""
        ...

    def close_reason(self, rnd: Round, round_timeout_s: float) -> tuple[str, str]:
        """Close: why ``rnd``, past its deadline, closes now (for people), and its metrics label."""
        ...

    def answer(self, job_id: str, rnd: Round, rank: int) -> None:
        """Answer: refuse ``rank`` a finished round's mean when the rules say it may not have it.

        Raises:
            FailedPreconditionError: the rules' refusal (LATE for a late member).
        """
        ...


class SyncRules:
    """Every round waits for every member; one short of members closes over --partial-quorum ranks, if set."""

    __slots__ = ()

    def counts_inline(self) -> bool:
        return True

    def takes_late(self, rnd: Round, rank: int) -> bool:
        return False  # a push to a closed round is answered from it (its mean or its failure)

    def counted(self, rnd: Round, now: float) -> None:
        return None

    def quorum(self, partial_quorum: int) -> tuple[int, bool]:
        return partial_quorum, True

    def close_reason(self, rnd: Round, round_timeout_s: float) -> tuple[str, str]:
        return f"deadline of {round_timeout_s:g} s passed", "deadline"

    def answer(self, job_id: str, rnd: Round, rank: int) -> None:
        return None


SYNC_RULES = SyncRules()  # holds nothing: one for every synchronous job


class SemiSyncRules:
    """Semi-synchronous rounds (gradq.server.semi_sync): a quorum of hosts and a grace window close a round.

    Args:
        settings: the job's quorum (hosts) and grace window (seconds).
    """

    __slots__ = ("settings",)

    def __init__(self, settings: SemiSync) -> None:
        self.settings = settings

    def counts_inline(self) -> bool:
        return False  # a late push takes the job table's lock and may close rounds: never on the event loop

    def takes_late(self, rnd: Round, rank: int) -> bool:
        result = rnd.result
        if not rnd.done.is_set() or result is None or rank in result.contributors:
            return False
        rnd.late.add(rank)  # answered: merged into the next round; fetch the state
        return True

    def counted(self, rnd: Round, now: float) -> None:
        if not rnd.graced and len(rnd.contributors) >= self.settings.quorum:
            rnd.graced = True
            rnd.deadline = min(rnd.deadline, now + self.settings.grace_s)  # the sweeper closes it then

    def quorum(self, partial_quorum: int) -> tuple[int, bool]:
        return self.settings.quorum, False  # hosts, not ranks: JoinRequest.semi_sync counts members

    def close_reason(self, rnd: Round, round_timeout_s: float) -> tuple[str, str]:
        if not rnd.graced:
            return SYNC_RULES.close_reason(rnd, round_timeout_s)
        grace = f"grace window of {self.settings.grace_s:g} s after a quorum of {self.settings.quorum}"
        return f"{grace} passed", "grace"

    def answer(self, job_id: str, rnd: Round, rank: int) -> None:
        if rank in rnd.late:
            raise FailedPreconditionError(
                f"member {rank} was late for {rnd.describe(job_id)}, which closed on its quorum without it: its "
                f"push is merged into the next round, and it is pending until the next outer-round boundary "
                f"(FetchState)",
                Refusal.LATE,
            )


def rules_for(semi_sync: SemiSync | None) -> RoundRules:
    """The rules of a job whose Joins asked for ``semi_sync`` (None: synchronous rounds)."""
    return SYNC_RULES if semi_sync is None else SemiSyncRules(semi_sync)
