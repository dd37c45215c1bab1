"""What one client may take of a shared aggregator: steps ahead, rounds, jobs, ranks, memory, waiting calls."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ServiceLimits", "default_memory_budget"]


def default_memory_budget() -> int:
    """Half the machine's physical memory, in bytes (1 GiB where the OS does not say).

    Half, because the process also holds gRPC's buffers, the messages being
    parsed and Python itself beside the budgeted accumulators and means.

    Returns:
        The budget in bytes.
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 1 << 30


@dataclass(frozen=True, slots=True)
class ServiceLimits:
    """Bounds that keep one job (or one hostile client) from breaking the others.

    Args:
        max_steps_ahead: a new round's step may be at most this far past the
            job's newest completed step (or, before any completes, its first
            round's step). Covers pipelining; a stray far-future step is refused.
        max_open_rounds: rounds of one job in flight at once.
        max_jobs: jobs known at once; a Join for a new job past it is refused.
        max_jobs_per_peer: jobs that Joins from one client host may have started
            and the table still knows. By default ``max_jobs`` (no limit of its
            own); set it lower where untrusted hosts share the aggregator, so one
            host inventing job ids cannot take the whole table from the others.
        max_world_size: largest job a Join may ask for, in ranks (``job_ranks``); a
            job's members, an elastic job's member ids and a job's Watch streams too.
        job_idle_timeout_s: a job with no Join, PushPull or Leave this long is
            forgotten (its rounds fail), so abandoned jobs do not pile up.
        max_memory_bytes: accumulators of open rounds, retained means, remembered
            failures and server error-feedback residuals; a push that would open a
            round past it is refused.
        max_job_memory_bytes: the most of that one job may hold, so a job that
            opens rounds it never completes cannot take the budget from the others.
        max_waiting_per_job: pushes (calls or on streams) of one job waiting for rounds at once.
        max_waiting_per_peer: pushes from one client host waiting at once.
        max_waiting_calls: pushes waiting at once in all. A waiting call
            holds no thread, only its coroutine and gRPC's call state
            (bench/results/operating-measurements.md), so this bounds memory.
        max_streams_per_peer: PushPullStream calls open at once from one client
            host, over all its connections: a rank opens one per connection to
            a shard, up to 9 where the path is long (8 for its pushes besides
            its first; gradq.client.shard_connections), so 128 serves 14 such
            ranks on a host. Each stream may hold requests not yet in their
            rounds, so a host opening streams without end is refused.
        max_watches: Watch streams open at once in all (one per joined rank:
            how the aggregator learns in a moment that a rank's process is gone).
            A stream is a parked coroutine and an HTTP/2 stream, like a waiting call.
    """

    max_steps_ahead: int = 4
    max_open_rounds: int = 256
    max_jobs: int = 1024
    max_jobs_per_peer: int = -1  # -1: max_jobs
    max_world_size: int = 1024
    job_idle_timeout_s: float = 600.0
    max_memory_bytes: int = -1  # -1: default_memory_budget(), resolved in __post_init__
    max_job_memory_bytes: int = -1  # -1: a quarter of max_memory_bytes
    max_waiting_per_job: int = 1024
    max_waiting_per_peer: int = 1024
    max_waiting_calls: int = 4096
    max_watches: int = 4096
    max_streams_per_peer: int = 128

    def __post_init__(self) -> None:
        if self.max_memory_bytes == -1:
            object.__setattr__(self, "max_memory_bytes", default_memory_budget())
        if self.max_jobs_per_peer == -1:
            object.__setattr__(self, "max_jobs_per_peer", self.max_jobs)
        if self.max_job_memory_bytes == -1:
            object.__setattr__(self, "max_job_memory_bytes", max(1, self.max_memory_bytes // 4))
        for name in (
            "max_open_rounds",
            "max_jobs",
            "max_jobs_per_peer",
            "max_world_size",
            "max_memory_bytes",
            "max_job_memory_bytes",
            "max_waiting_per_job",
            "max_waiting_per_peer",
            "max_waiting_calls",
            "max_watches",
            "max_streams_per_peer",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; expected >= 1")
        if self.max_steps_ahead < 0:
            raise ValueError(f"max_steps_ahead={self.max_steps_ahead} is invalid; expected >= 0")
        if not self.job_idle_timeout_s > 0:
            raise ValueError(f"job_idle_timeout_s={self.job_idle_timeout_s} is invalid; expected > 0 seconds")
