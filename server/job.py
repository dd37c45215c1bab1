"""One run of a job id: what the job table holds of it (gradq.server.jobs keeps the runs)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from gradq.qcore import ErrorFeedback
from gradq.server.budget import MemoryAccount
from gradq.server.errors import FailedPreconditionError
from gradq.server.job_spec import JobSpec
from gradq.server.membership import Membership
from gradq.server.outer_state import OuterState
from gradq.server.round_rules import SYNC_RULES, RoundRules, rules_for
from gradq.server.round_state import Round
from gradq.server.semi_sync import LateStash, SemiSync

__all__ = ["Job", "describe_incarnation"]


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

    def agree_on_rounds(self, spec: JobSpec) -> None:
        """The run's first Join fixes its outer step, its rounds and its weighting; a later Join must name the same.

        Caller holds the job table's lock.

        Raises:
            FailedPreconditionError: ``spec`` names other weighting, semi-sync rounds or outer step.
        """
        outer_step, semi_sync = spec.outer_step, spec.semi_sync
        if self.members.empty and self.outer is None:
            self.outer = OuterState(outer_step) if outer_step is not None else None
            self.semi_sync = semi_sync
            self.rules = rules_for(semi_sync)
            self.weighted = spec.weighted
            return
        if spec.weighted != self.weighted:
            theirs = "carry weights" if self.weighted else "carry none"
            raise FailedPreconditionError(
                f"weighted={spec.weighted} does not match {self.describe()}, whose pushes {theirs}; every host of "
                f"a job must say the same"
            )
        if semi_sync != self.semi_sync:
            mine = semi_sync.describe() if semi_sync is not None else "none (synchronous)"
            theirs = self.semi_sync.describe() if self.semi_sync is not None else "none (synchronous)"
            raise FailedPreconditionError(
                f"semi_sync {mine} does not match {self.describe()}, whose rounds are {theirs}; every host of a job "
                f"must say the same"
            )
        held = self.outer.step if self.outer is not None else None
        if held != outer_step:
            mine = outer_step.describe() if outer_step is not None else "none (the aggregator only averages)"
            theirs = held.describe() if held is not None else "none (the aggregator only averages)"
            raise FailedPreconditionError(
                f"outer_step {mine} does not match {self.describe()}, whose outer step is {theirs}; every host of a "
                f"DiLoCo job must run the outer step in the same place with the same settings"
            )
