"""One round's state: its fp32 accumulator, who has contributed, and the answer they all receive."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gradq.proto.transport import MAX_PUSH_WEIGHT
from gradq.qcore import QuantizedArray, decode_times
from gradq.server.errors import RoundError
from gradq.server.policy import PushedGrid

__all__ = ["FAILED_ROUND_BYTES", "MAX_PUSH_WEIGHT", "Round", "RoundResult", "Waker", "contribution_weight"]

# What a failed round kept to answer late pushes holds besides its error's message: the
# Round with its lock, event and emptied per-rank sets (about 2.7 KiB measured by
# tests/server/test_late_pushes.py), charged to its job's memory budget.
FAILED_ROUND_BYTES = 4096


def contribution_weight(ranks: int, weight: int) -> tuple[int, float]:
    """What a push counts for in its round's mean, and what each of its values is multiplied by.

    A member of ``ranks`` ranks pushes their sum. Unweighted (``weight`` 0) it
    counts its ranks, values as they are; weighted, it counts ``weight`` and
    each value ``weight / ranks`` times, so a host's sum over its ranks stands
    for what the host trained on.
    """
    if not weight:
        return ranks, 1.0
    return weight, weight / ranks


class Waker(Protocol):
    """What a waiting call hands its round: ``set()`` is called once the round is done, from any thread."""

    def set(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What every waiter of a finished round receives.

    It holds the mean once: as ``encoded`` for in-process callers, or, once the
    table has packaged it (the aggregator), only as ``packaged``, its wire
    form; the round keeps it for retries, so a second copy would double what
    the retained steps hold.
    """

    encoded: QuantizedArray | None  # the mean on the return grid; None once packaged
    contributors: tuple[int, ...]
    missing: tuple[int, ...] = ()
    ranks: int = 0  # the ranks the contributors stand for: what the mean divides by
    skipped: bool = False  # a rank reported non-finite values; the mean is zeros
    # The answer in its wire form, built once per round by the table's ``package``
    # callable, so W waiters do not serialize the same mean W times.
    packaged: bytes | None = None
    mean_bytes: int = -1  # the encoded mean's size (``QuantizedArray.nbytes``); set from ``encoded``

    def __post_init__(self) -> None:
        if self.mean_bytes < 0:
            object.__setattr__(self, "mean_bytes", self.encoded.nbytes if self.encoded is not None else 0)

    @property
    def mean(self) -> QuantizedArray:
        """The mean on the return grid.

        Raises:
            ValueError: the result was packaged; its mean is in ``packaged`` only.
        """
        if self.encoded is None:
            raise ValueError("this round's mean was packaged: read it from RoundResult.packaged")
        return self.encoded

    @property
    def partial(self) -> bool:
        """True when the round closed on a quorum with ranks missing."""
        return bool(self.missing)

    @property
    def retained_bytes(self) -> int:
        """What keeping this result for retries holds: its wire form once packaged, else the encoded mean."""
        return len(self.packaged) if self.packaged is not None else self.mean_bytes


class Round:
    """One round in flight (or finished and kept for retries); the table holds its lock while changing it."""

    __slots__ = (
        "accumulator",
        "arrivals",
        "averaged",
        "bucket",
        "charged",
        "contributors",
        "deadline",
        "decoded",
        "digests",
        "done",
        "error",
        "graced",
        "late",
        "lock",
        "non_finite",
        "opened_at",
        "pushed",
        "ranks",
        "received_bytes",
        "relative_error",
        "result",
        "step",
        "wakers",
        "wakers_lock",
        "weight",
    )

    def __init__(self, step: int, bucket: int, pushed: PushedGrid, deadline: float, accumulator: np.ndarray) -> None:
        self.step = step
        self.bucket = bucket
        # The first contribution fixes numel and, by default, the return grid.
        self.pushed = pushed
        self.deadline = deadline
        self.lock = threading.Lock()
        self.done = threading.Event()
        # Filled by the first decoded contribution, so it is never zeroed (a memset of the whole bucket).
        self.accumulator: np.ndarray | None = accumulator  # pushed.numel float32 elements
        self.decoded = 0  # contributions in the accumulator
        self.averaged = False  # the last contribution already divided the sum by the ranks
        self.non_finite: set[int] = set()  # ranks that reported NaN/Inf (under the skip policy)
        # For metrics: when the round opened, when each rank arrived, bytes in, error out.
        self.opened_at = time.monotonic()
        self.arrivals: dict[int, float] = {}
        self.received_bytes = 0
        self.relative_error: float | None = None
        self.contributors: set[int] = set()
        self.ranks = 0  # the ranks the contributors stand for (more than one each under two-level aggregation)
        # What the mean divides by: ``ranks``, or in a weighted job (JoinRequest.weighted) their pushes' weights.
        self.weight = 0
        # rank -> digest of what it pushed, so a resend with other content is refused, not answered.
        self.digests: dict[int, int] = {}
        # The calls waiting for this round, woken when it finishes. Their own lock, held for
        # microseconds, never while decoding: the event loop adds and removes them.
        self.wakers: set[Waker] = set()
        self.wakers_lock = threading.Lock()
        self.charged = 0  # bytes this round holds against the memory budget
        self.result: RoundResult | None = None
        self.error: RoundError | None = None
        # Semi-synchronous (gradq.server.semi_sync): its quorum has pushed, so its deadline is the grace
        # window's end; the members whose pushes came after it closed, merged into the key's next round.
        self.graced = False
        self.late: set[int] = set()

    @property
    def failure_bytes(self) -> int:
        """What keeping this failed round holds: ``FAILED_ROUND_BYTES`` and its error's message."""
        return FAILED_ROUND_BYTES + len(str(self.error))

    def forget_ranks(self) -> None:
        """Drop the per-rank state a failed round no longer needs (it answers every push with its error)."""
        self.contributors.clear()  # clear() gives a grown table back; the objects stay small
        self.digests.clear()
        self.arrivals.clear()
        self.non_finite.clear()

    def describe(self, job_id: str) -> str:
        return f"round (job={job_id!r}, step={self.step}, bucket={self.bucket})"

    def accumulate(self, tensor: QuantizedArray, last: bool, weight: int, times: float = 1.0) -> None:
        """Dequantize a finite contribution, ``times`` over, into the accumulator.

        The first one is written, not added (the accumulator is never zeroed);
        the round's ``last`` one divides by ``weight`` (what the contributors,
        this one included, stand for: their ranks, or their pushes' weights) in
        the same pass, turning the sum into the mean without another pass over
        the bucket. ``times``: what one of this push's values counts for (a
        weighted push's weight over its member's ranks; 1 otherwise).
        """
        assert self.accumulator is not None, "the round has been released"
        last = last and not self.non_finite
        if self.decoded:
            decode_times(tensor, self.accumulator, times, accumulate=True, divide_by=weight if last else 1)
            self.averaged = last
        else:
            decode_times(tensor, self.accumulator, times, accumulate=False)
            self.averaged = last and weight == 1
        self.decoded += 1

    def mean(self) -> np.ndarray:
        """The accumulator turned into the mean over the contributors; zeros when a rank reported NaN/Inf."""
        mean = self.accumulator
        assert mean is not None, "the round has been released"
        if self.non_finite or not self.decoded:
            mean[:] = 0.0  # skip the step for everyone: no rank applies a poisoned mean
        elif not self.averaged:
            mean /= np.float32(self.weight)
        return mean
