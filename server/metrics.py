"""Prometheus metrics for the aggregator (`gradq serve --metrics-port`).

Answers an operator's three questions per job: is it healthy (rounds by
outcome and reason), what is it saving (bytes, compression ratio), and what
does it cost (error of the mean sent back, round latency, straggler wait).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from gradq.proto.convert import DTYPE_BYTES
from gradq.server.budget import MemoryBudget
from gradq.server.reports import RoundReport

__all__ = ["DEFAULT_FINISHED_JOB_SERIES_S", "JobTotals", "RoundMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Jobs whose series are kept (the server passes --max-jobs); the one that finished a round longest ago goes first.
DEFAULT_MAX_JOB_SERIES = 1024
# How long a job that ended keeps its series, with their final values: two scrapes at Prometheus' usual 1-minute
# interval see its last rounds and leaves, and then the series go, so /metrics does not grow with every job run.
DEFAULT_FINISHED_JOB_SERIES_S = 120.0


@dataclass(slots=True)
class JobTotals:
    """One job id's counts as /metrics shows them (every run of the id since the aggregator started)."""

    rounds: dict[str, int]  # outcome (completed, partial, skipped, failed) -> rounds, over every reason
    received_bytes: int = 0
    sent_bytes: int = 0
    compression_ratio: float | None = None  # of the last round; None before one with bytes


class RoundMetrics:
    """A RoundObserver that keeps Prometheus series in its own registry.

    Series are labelled by job, and jobs come and go for as long as the
    aggregator runs (or as fast as a client invents job ids). A job that
    ended (its last rank left, or it expired) keeps its series, its members
    at 0, for ``finished_job_series_s``, and then they are removed, as a
    Prometheus exporter drops the series of a thing that is gone. Besides,
    the series of at most ``max_jobs`` jobs are kept: those that finished a
    round most recently. A removed job's series disappear from /metrics.

    Args:
        registry: where the series live (a new one by default).
        max_jobs: jobs whose series are kept at once.
        finished_job_series_s: how long an ended job keeps its series (see ``drop_ended``).
        clock: monotonic seconds; tests may pass their own.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        max_jobs: int = DEFAULT_MAX_JOB_SERIES,
        finished_job_series_s: float = DEFAULT_FINISHED_JOB_SERIES_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not finished_job_series_s >= 0:
            raise ValueError(f"finished_job_series_s={finished_job_series_s} is invalid; expected >= 0 seconds")
        self.registry = registry or CollectorRegistry()
        self.max_jobs = max_jobs
        self.finished_job_series_s = finished_job_series_s
        self._clock = clock
        self._lock = threading.Lock()  # rounds finish on any of the server's threads
        # job -> the (metric, label values) series it has, oldest job first.
        self._jobs: OrderedDict[str, set[tuple[Any, tuple[str, ...]]]] = OrderedDict()
        # job with series -> when it was first seen ended; its series go finished_job_series_s later.
        self._ended: dict[str, float] = {}
        job = ["job"]
        self.rounds = Counter(
            "gradq_rounds",
            "Rounds finished, by outcome and reason",
            ["job", "outcome", "reason"],
            registry=self.registry,
        )
        self.contributions = Counter("gradq_contributions", "Contributions averaged", job, registry=self.registry)
        self.received_bytes = Counter(
            "gradq_received_bytes", "Wire bytes of accepted contributions", job, registry=self.registry
        )
        self.sent_bytes = Counter("gradq_sent_bytes", "Wire bytes of means sent back", job, registry=self.registry)
        self.fp32_bytes = Counter(
            "gradq_fp32_equivalent_bytes", "What the accepted contributions weigh in fp32", job, registry=self.registry
        )
        self.uncompressed_bytes = Counter(
            "gradq_uncompressed_bytes",
            "What the accepted contributions weigh in the dtype they were pushed from",
            ["job", "dtype"],
            registry=self.registry,
        )
        self.compression_ratio = Gauge(
            "gradq_compression_ratio",
            "Uncompressed bytes (in the pushed dtype) / wire bytes of the last round's contributions",
            job,
            registry=self.registry,
        )
        self.relative_error = Gauge(
            "gradq_mean_relative_error",
            "||mean sent - fp32 mean|| / ||fp32 mean|| of the last round",
            job,
            registry=self.registry,
        )
        self.round_seconds = Histogram(
            "gradq_round_seconds",
            "First contribution to the round's end",
            job,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.straggler_seconds = Histogram(
            "gradq_straggler_wait_seconds",
            "Time a round waited for its last rank after the one before",
            job,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.slowest_rank = Gauge(
            "gradq_slowest_rank", "Rank that arrived last in the last round", job, registry=self.registry
        )
        self.slowest_rank_rounds = Counter(
            "gradq_slowest_rank_rounds",
            "Rounds in which this rank arrived last",
            ["job", "rank"],
            registry=self.registry,
        )

        self.membership_events = Counter(
            "gradq_membership_events",
            "Elastic jobs' membership changes: joined, waiting (for the state), admitted, rank_lost, rank_left",
            ["job", "event"],
            registry=self.registry,
        )
        self.members = Gauge(
            "gradq_job_members", "Members training in an elastic job after its last change", job, registry=self.registry
        )
        # process_start_time_seconds (a restart) and process_resident_memory_bytes, for the alerts and dashboard.
        ProcessCollector(registry=self.registry)
        self.memory_budget = Gauge(
            "gradq_memory_budget_bytes", "The memory budget (--max-memory-bytes)", registry=self.registry
        )
        self.memory_in_use = Gauge(
            "gradq_memory_in_use_bytes",
            "Bytes of the memory budget held now (rounds, retained means, residuals, grids, DiLoCo state, relays)",
            registry=self.registry,
        )

    def watch_budget(self, budget: MemoryBudget) -> None:
        """Read ``budget``'s limit and use at every scrape."""
        self.memory_budget.set_function(lambda: budget.limit)
        self.memory_in_use.set_function(lambda: budget.in_use)

    def round_finished(self, report: RoundReport) -> None:
        """Record one finished round."""
        with self._lock:
            self._record(report)

    def membership_changed(self, job: str, event: str, members: int) -> None:
        """Record one change of an elastic job's members (``members`` training after it)."""
        with self._lock:
            self._keep(job)
            self._series(self.membership_events, job, event).inc()
            self._series(self.members, job).set(members)

    def drop_ended(self, live_jobs: Callable[[], set[str]]) -> None:
        """Remove the series of jobs that ended ``finished_job_series_s`` ago or more (the server's sweeper calls this).

        Args:
            live_jobs: the ids of the jobs the aggregator holds now. It is called after the jobs with series are
                read, so a job that gained series meanwhile has joined and is among them, unless it ended.
        """
        with self._lock:
            known = list(self._jobs)
        live = live_jobs()
        now = self._clock()
        with self._lock:
            for job in known:
                if job in live or job not in self._jobs:
                    self._ended.pop(job, None)  # running again (the same id restarted), or evicted meanwhile
                    continue
                if job not in self._ended:
                    self._ended[job] = now
                    if (self.members, (job,)) in self._jobs[job]:
                        self.members.labels(job).set(0)  # an expired job's members are gone too
                if now - self._ended[job] >= self.finished_job_series_s:
                    self._remove(job)

    def _remove(self, job: str) -> None:
        for metric, labels in self._jobs.pop(job):
            metric.remove(*labels)
        self._ended.pop(job, None)

    def _series(self, metric: Any, job: str, *labels: str) -> Any:
        self._jobs[job].add((metric, (job, *labels)))
        return metric.labels(job, *labels)

    def _keep(self, job: str) -> None:
        """Make ``job`` the most recent job with series, evicting the oldest past ``max_jobs``."""
        if job in self._jobs:
            self._jobs.move_to_end(job)
        else:
            self._jobs[job] = set()
            while len(self._jobs) > self.max_jobs:
                self._remove(next(iter(self._jobs)))

    def _record(self, report: RoundReport) -> None:
        job = report.job_id
        self._keep(job)
        series = self._series
        series(self.rounds, job, report.outcome, report.reason or "none").inc()
        series(self.round_seconds, job).observe(report.seconds)
        if report.outcome == "failed":
            return
        fp32 = 4 * report.numel * report.contributors
        series(self.contributions, job).inc(report.contributors)
        series(self.received_bytes, job).inc(report.received_bytes)
        series(self.sent_bytes, job).inc(report.sent_bytes)
        series(self.fp32_bytes, job).inc(fp32)
        uncompressed = DTYPE_BYTES[report.dtype] * report.numel * report.contributors
        series(self.uncompressed_bytes, job, report.dtype).inc(uncompressed)
        if report.received_bytes:
            series(self.compression_ratio, job).set(uncompressed / report.received_bytes)
        if report.relative_error is not None:
            series(self.relative_error, job).set(report.relative_error)
        series(self.straggler_seconds, job).observe(report.straggler_seconds)
        if report.slowest_rank >= 0:
            series(self.slowest_rank, job).set(report.slowest_rank)
            series(self.slowest_rank_rounds, job, str(report.slowest_rank)).inc()

    def totals(self) -> dict[str, JobTotals]:
        """Job id -> its counts, read from the series themselves, so the status page and /metrics agree."""
        totals: dict[str, JobTotals] = {}

        def job(labels: dict[str, str]) -> JobTotals:
            return totals.setdefault(labels["job"], JobTotals(rounds={}))

        # One pass over each series' samples: no lock of ours is needed, each metric guards its own values.
        for sample in _samples(self.rounds, "gradq_rounds_total"):
            rounds = job(sample.labels).rounds
            rounds[sample.labels["outcome"]] = rounds.get(sample.labels["outcome"], 0) + int(sample.value)
        for sample in _samples(self.received_bytes, "gradq_received_bytes_total"):
            job(sample.labels).received_bytes = int(sample.value)
        for sample in _samples(self.sent_bytes, "gradq_sent_bytes_total"):
            job(sample.labels).sent_bytes = int(sample.value)
        for sample in _samples(self.compression_ratio, "gradq_compression_ratio"):
            job(sample.labels).compression_ratio = sample.value
        return totals


def _samples(metric: Any, name: str) -> list[Any]:
    """The samples called ``name`` of one metric (a counter also has ``*_created`` samples)."""
    return [sample for family in metric.collect() for sample in family.samples if sample.name == name]
