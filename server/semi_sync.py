"""Semi-synchronous rounds: close on a quorum and a grace window, and merge a late member's push into the next.

A DiLoCo job may ask for them (JoinRequest.semi_sync) so that one slow host
does not hold every outer round: a round closes once ``quorum`` members have
pushed and ``grace_s`` more seconds have passed, or once every member has.

A member whose push reaches a round that closed without it is late. Its
contribution is not lost: it is dequantized into the key's *late stash* and
merged into the key's next round to finish, as one more member's (weight 1:
see ``LATE_WEIGHT``). The late member becomes pending, so the rounds after do
not wait for it, and at the next outer-round boundary it receives the job's
global state from the aggregator, as a joiner does (gradq.server.outer_service),
and trains on from there, bit-identical to the others.

Thread model: a stash is guarded by the job table's lock; the arrays it holds
are charged to the job's memory budget until merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gradq.qcore import QuantizedArray, decode_times

__all__ = ["LATE_WEIGHT", "LateStash", "SemiSync"]

# What a late pseudo-gradient counts for in the round it is merged into, against an on-time one's 1.
# It was taken one outer round earlier, from the global parameters before the last step; it still
# points where that host's data leads, and a DiLoCo round's mean is an average of such directions (the
# outer learning rate is tuned to a mean's scale, so the merge keeps it one). Counting it fully keeps
# every host's data in the model in proportion to what it trained. One round stale is the most a stash
# holds: a member late again is pending, not pushing, until it has the state.
LATE_WEIGHT = 1.0
MAX_GRACE_S = 3600.0


@dataclass(frozen=True, slots=True)
class SemiSync:
    """A job's quorum and grace window.

    Raises:
        ValueError: ``quorum`` < 1, or ``grace_s`` not in [0, MAX_GRACE_S].
    """

    quorum: int
    grace_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "grace_s", float(np.float32(self.grace_s)))
        if self.quorum < 1:
            raise ValueError(f"quorum={self.quorum} is invalid; expected >= 1 members")
        if not (math.isfinite(self.grace_s) and 0 <= self.grace_s <= MAX_GRACE_S):
            raise ValueError(f"grace_s={self.grace_s!r} is invalid; expected seconds in [0, {MAX_GRACE_S:g}]")

    def describe(self) -> str:
        return f"quorum={self.quorum} grace_s={self.grace_s:g}"


@dataclass(eq=False, slots=True)
class LateStash:
    """One round key's late contributions, summed, waiting for the key's next round to finish."""

    total: np.ndarray  # float32 sum of the late contributions (each ``times`` over: see contribution_weight)
    ranks: int = 0  # the ranks they stand for
    weight: int = 0  # what they count for in a mean: their ranks, or in a weighted job their pushes' weights
    members: set[int] = field(default_factory=set)  # (member, step) pairs already counted

    @classmethod
    def first(cls, tensor: QuantizedArray, ranks: int, member: int, weight: int = 0, times: float = 1.0) -> LateStash:
        total = np.empty(tensor.numel, np.float32)
        decode_times(tensor, total, times, accumulate=False)
        return cls(total, ranks, weight or ranks, {member})

    @property
    def nbytes(self) -> int:
        return int(self.total.nbytes)

    def add(self, tensor: QuantizedArray, ranks: int, member: int, weight: int = 0, times: float = 1.0) -> bool:
        """Count one more late contribution; False when it is the member's second one (a resend) or misfits."""
        if member in self.members or tensor.numel != self.total.size:
            return False
        decode_times(tensor, self.total, times, accumulate=True)
        self.ranks += ranks
        self.weight += weight or ranks
        self.members.add(member)
        return True

    def merge_into(self, mean: np.ndarray, weight: int) -> int:
        """Fold the stash into a round's ``mean`` over ``weight`` in place; returns the weight the mean is now over."""
        total = weight + LATE_WEIGHT * self.weight
        np.multiply(mean, np.float32(weight), out=mean)
        np.add(mean, np.float32(LATE_WEIGHT) * self.total, out=mean)
        np.divide(mean, np.float32(total), out=mean)
        return round(total)
