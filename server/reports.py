"""What the round logic tells an observer (metrics, logs) about each finished round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["RoundReport", "RoundObserver", "RoundObservers"]


@dataclass(frozen=True, slots=True)
class RoundReport:
    """One finished round, for metrics.

    Attributes:
        job_id: the job.
        outcome: "completed", "partial", "skipped" or "failed".
        reason: why it failed or closed early ("deadline", "rank_left",
            "non_finite", "overflow", "shutdown"); "" when it completed.
        contributors: ranks averaged (or seen, for a failed round).
        numel: elements per bucket.
        received_bytes: wire bytes of the contributions accepted.
        sent_bytes: wire bytes of the mean, times the ranks it is sent to.
        seconds: first contribution to the round's end.
        straggler_seconds: how long the round waited for its last rank after
            the one before it arrived (0 with fewer than two ranks).
        slowest_rank: the rank that arrived last (-1 if none).
        relative_error: ||mean sent - fp32 mean|| / ||fp32 mean|| (None if not computed).
        dtype: the element type the ranks pushed (their buckets' own), the
            baseline of the compression ratio.
        error: what every waiter of a failed round was told ("" otherwise).
    """

    job_id: str
    outcome: str
    reason: str
    contributors: int
    numel: int
    received_bytes: int
    sent_bytes: int
    seconds: float
    straggler_seconds: float
    slowest_rank: int
    relative_error: float | None
    dtype: str = "float32"
    error: str = ""


class RoundObserver(Protocol):
    """Receives a report when a round finishes (called with no table lock held)."""

    def round_finished(self, report: RoundReport) -> None:
        """Record ``report``."""


class RoundObservers:
    """Tells each of several observers (metrics, the status page's error list) about every round, in order."""

    def __init__(self, *observers: RoundObserver) -> None:
        self._observers = observers

    def round_finished(self, report: RoundReport) -> None:
        """Hand ``report`` to every observer."""
        for observer in self._observers:
            observer.round_finished(report)
