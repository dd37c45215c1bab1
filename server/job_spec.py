"""What a member says of itself and of its job when it joins: one value, from the wire to the membership.

A Join's fields travel as one ``JobSpec`` from the servicer (``serde.job_spec_of``)
through the round table to the job table and the membership, and are checked
once (``check``): a new Join option is a field of the proto, of this class and
of the check, not a parameter restated in every layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gradq.qcore.outer_step import OuterStep
from gradq.server.errors import InvalidArgumentError
from gradq.server.semi_sync import SemiSync

__all__ = ["ANY_RANK", "MAX_JOB_ID_LENGTH", "MAX_SIGNATURE_CHARACTERS", "JobSpec", "MemberRole", "check_job_id"]

# An elastic Join's rank asking the aggregator for the lowest free member id (uint32's largest).
ANY_RANK = 0xFFFFFFFF
MAX_JOB_ID_LENGTH = 256
# The longest model signature a Join may carry (one line per tensor; GPT-2's is about 8 KB).
MAX_SIGNATURE_CHARACTERS = 1 << 20


class MemberRole(enum.Enum):
    """What an elastic member brings to a Join; mirrors the proto enum MemberRole (parity-tested).

    It decides what a shard that holds no run of the job (one that restarted)
    makes of the Join, so that a restart never hands the job to whoever dials first.
    """

    STARTING = 0  # holds no state: one of the hosts the job starts with, or a newcomer that does not know yet
    JOINING = 1  # pending on the first shard: a newcomer to a run in training; pending here too
    RESUMING = 2  # has trained in this run: its incarnation is the run's, and it trains here at once


def check_job_id(job_id: str) -> None:
    """Refuse an empty or over-long job id (before anything quotes it).

    Raises:
        InvalidArgumentError: naming the first 40 characters and the limit.
    """
    if not job_id or len(job_id) > MAX_JOB_ID_LENGTH:
        raise InvalidArgumentError(f"job_id={job_id[:40]!r} is invalid; expected 1..{MAX_JOB_ID_LENGTH} characters")


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One Join: who the member is and what it says the job is. Every Join of a run must agree on the job."""

    job_id: str
    rank: int  # the member id, or ANY_RANK (elastic) for the lowest free one
    world_size: int  # the members the job starts with
    incarnation: str = ""  # the run; an elastic Join into a live run adopts the run's
    ranks: int = 1  # the job's ranks this member stands for (a host's, under two-level aggregation)
    elastic: bool = False
    job_ranks: int = 0  # the job's ranks in all (0: world_size, one per member, not checked)
    max_members: int = 0  # elastic: the most members at once (0: only --max-world-size)
    model_signature: str = ""  # elastic: the host's model, one line per tensor ("": unchecked)
    outer_step: OuterStep | None = None  # DiLoCo: the outer step the aggregator runs (None: it only averages)
    semi_sync: SemiSync | None = None  # with outer_step: quorum and grace window of a round
    role: MemberRole = MemberRole.STARTING  # elastic: what the member holds (see MemberRole)
    training_members: int = 0  # RESUMING: the members training when it last heard (0: world_size)
    weighted: bool = False  # every push carries a weight (PushPullRequest.weight); means are weighted by them

    def check(self, max_world_size: int) -> None:
        """Refuse a Join that is malformed on its own, whatever the job holds.

        Args:
            max_world_size: --max-world-size, the most members and member ids a job may have.

        Raises:
            InvalidArgumentError: naming the field, its value and what was expected.
        """
        check_job_id(self.job_id)
        if self.rank == ANY_RANK and not self.elastic:
            raise InvalidArgumentError(f"rank={ANY_RANK} (any) is only valid in an elastic Join; expected a rank")
        if self.elastic and self.rank != ANY_RANK and self.rank >= max_world_size:
            raise InvalidArgumentError(
                f"rank={self.rank} is out of range; expected 0..{max_world_size - 1} (--max-world-size) "
                f"or {ANY_RANK} (any) for an elastic member"
            )
        if len(self.model_signature) > MAX_SIGNATURE_CHARACTERS:
            raise InvalidArgumentError(
                f"model_signature holds {len(self.model_signature)} characters; expected at most "
                f"{MAX_SIGNATURE_CHARACTERS} (one line per tensor of the host's model)"
            )
        if self.outer_step is not None and not self.elastic:
            raise InvalidArgumentError(
                f"outer_step ({self.outer_step.describe()}) is only valid in an elastic Join: DiLoCo's hosts are "
                "the members of an elastic job"
            )
        if self.semi_sync is not None and self.outer_step is None:
            raise InvalidArgumentError(
                f"semi_sync ({self.semi_sync.describe()}) needs outer_step: a late host takes the job's state from "
                f"the aggregator's copy of it"
            )
        if self.training_members and (self.role is not MemberRole.RESUMING or self.training_members > max_world_size):
            raise InvalidArgumentError(
                f"training_members={self.training_members} is invalid; expected 0, or 1..{max_world_size} "
                f"(--max-world-size) from a RESUMING member"
            )
        if self.role is not MemberRole.STARTING and not self.elastic:
            raise InvalidArgumentError(
                f"role={self.role.name} is only valid in an elastic Join; expected STARTING (0) for a fixed job"
            )
        if not 1 <= self.world_size <= max_world_size:
            raise InvalidArgumentError(
                f"world_size={self.world_size} is invalid; expected 1..{max_world_size} (--max-world-size)"
            )
        if self.job_ranks and not self.world_size <= self.job_ranks <= max_world_size:
            raise InvalidArgumentError(
                f"job_ranks={self.job_ranks} is invalid; expected {self.world_size}..{max_world_size}: at least one "
                f"rank per member (world_size={self.world_size}), at most --max-world-size"
            )
        # An elastic job's member ids outgrow its starting world_size as hosts are replaced.
        if not self.elastic and self.rank >= self.world_size:
            raise InvalidArgumentError(
                f"rank={self.rank} is out of range; expected 0..{self.world_size - 1} for world_size={self.world_size}"
            )
        if not 1 <= self.ranks <= max_world_size:
            raise InvalidArgumentError(
                f"ranks={self.ranks} is invalid; expected 1..{max_world_size} (--max-world-size): "
                f"the ranks member {self.rank} stands for"
            )
