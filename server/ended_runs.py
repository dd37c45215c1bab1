"""Runs that ended (their last member left with a Leave), remembered a while so a host that comes back is told.

A host cut off from its job while the others finished and left would otherwise
rejoin (as RESUMING) a run nobody else will ever join, and wait for a formation
that never comes. The memory is bounded both ways: each run for a set time
(--job-idle-timeout, the table's), and at most ``ENDED_KEPT`` at once, the
oldest forgotten first, so ending many jobs (a hostile client can) holds at
most that many keys. A key is the job id (at most MAX_JOB_ID_LENGTH) and a
16-byte digest of the incarnation (which has no length limit of its own).
Guarded by the job table's lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

__all__ = ["ENDED_KEPT", "EndedRuns"]

ENDED_KEPT = 4096


class EndedRuns:
    """Which runs of which jobs ended, and when (see the module docstring).

    Args:
        keep_s: how long a run is remembered after it ended.
        kept: the most runs remembered at once.
    """

    __slots__ = ("_keep_s", "_kept", "_runs")

    def __init__(self, keep_s: float, kept: int = ENDED_KEPT) -> None:
        self._keep_s = keep_s
        self._kept = kept
        self._runs: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # key -> when it ended, oldest first

    def __len__(self) -> int:
        return len(self._runs)

    def remembered(self) -> list[tuple[str, bytes]]:
        """What is remembered (for tests of the bound)."""
        return list(self._runs)

    def remember(self, job_id: str, incarnation: str, now: float) -> None:
        """Run ``incarnation`` of ``job_id`` ended at ``now``."""
        key = _key(job_id, incarnation)
        self._runs.pop(key, None)
        self._runs[key] = now
        while len(self._runs) > self._kept:
            self._runs.popitem(last=False)
        self._expire(now)

    def ended(self, job_id: str, incarnation: str, now: float) -> bool:
        """Whether run ``incarnation`` of ``job_id`` ended within the time kept."""
        self._expire(now)
        return _key(job_id, incarnation) in self._runs

    def forget(self, job_id: str, incarnation: str) -> None:
        """A new run under that incarnation started: it has not ended."""
        self._runs.pop(_key(job_id, incarnation), None)

    def _expire(self, now: float) -> None:
        while self._runs:
            key, when = next(iter(self._runs.items()))
            if now - when <= self._keep_s:
                return
            del self._runs[key]


def _key(job_id: str, incarnation: str) -> tuple[str, bytes]:
    return job_id, hashlib.blake2b(incarnation.encode("utf-8", "surrogatepass"), digest_size=16).digest()
