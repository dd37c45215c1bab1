"""A finished job's series on /metrics: every leave counted, members 0, then removed so /metrics does not grow."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
from conditions import wait_until
from prometheus_client.parser import text_string_to_metric_families

from gradq.client import JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.limits import ServiceLimits
from gradq.server.metrics import RoundMetrics
from gradq.server.policy import RoundPolicy
from gradq.server.reports import RoundReport

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def of_job(series: Series, job: str) -> Series:
    return {key: value for key, value in series.items() if ("job", job) in key[1]}


def start(linger_s: float, limits: ServiceLimits | None = None) -> AggregatorServer:
    options = ServerOptions("127.0.0.1:0", grace_s=0.5, metrics_port=0, finished_job_series_s=linger_s)
    server = AggregatorServer(RoundPolicy(round_timeout_s=20.0), options, limits)
    server.start()
    return server


def train_elastic_job(address: str, job: str) -> None:
    """Two elastic ranks join, run one round together and leave, one after the other."""
    members = [
        WorkerClient(address, job, ANY_RANK, JobSpec(world_size=2, elastic=True), EXACT, timeout_s=10) for _ in range(2)
    ]
    for member in members:
        member.join()
    threads = [threading.Thread(target=member.push_pull, args=(0, 0, np.ones(8, np.float32))) for member in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for member in members:
        member.close()


def test_every_leave_is_counted_and_a_finished_job_has_no_members() -> None:
    server = start(linger_s=600.0)
    try:
        assert server.metrics_port is not None
        train_elastic_job(f"127.0.0.1:{server.port}", "done")
        series = scrape(server.metrics_port)
    finally:
        server.stop()
    assert series[("gradq_membership_events_total", (("event", "joined"), ("job", "done")))] == 2
    assert series[("gradq_membership_events_total", (("event", "rank_left"), ("job", "done")))] == 2
    assert series[("gradq_job_members", (("job", "done"),))] == 0
    assert series[("gradq_rounds_total", (("job", "done"), ("outcome", "completed"), ("reason", "none")))] == 1


def test_a_finished_jobs_series_are_removed_after_the_linger() -> None:
    server = start(linger_s=0.5)
    try:
        port = server.metrics_port
        assert port is not None
        address = f"127.0.0.1:{server.port}"
        with WorkerClient(address, "running", 0, 1, EXACT, timeout_s=10) as running:
            running.push_pull(0, 0, np.ones(8, np.float32))
            train_elastic_job(address, "done")
            wait_until(lambda: not of_job(scrape(port), "done"), "the finished job's series to be removed", 30)
            # The job still running keeps its series however long it has been there.
            assert of_job(scrape(port), "running")
    finally:
        server.stop()


def test_an_expired_jobs_series_are_removed() -> None:
    server = start(linger_s=0.0, limits=ServiceLimits(job_idle_timeout_s=0.5))
    try:
        port = server.metrics_port
        assert port is not None
        client = WorkerClient(f"127.0.0.1:{server.port}", "idle", 0, 1, EXACT, timeout_s=10)
        client.push_pull(0, 0, np.ones(8, np.float32))
        assert of_job(scrape(port), "idle")
        wait_until(lambda: not of_job(scrape(port), "idle"), "the expired job's series to be removed", 30)
        client.close()
    finally:
        server.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def jobs_with_series(metrics: RoundMetrics) -> set[str]:
    return {
        sample.labels["job"]
        for family in metrics.registry.collect()
        for sample in family.samples
        if "job" in sample.labels
    }


def test_an_ended_job_keeps_its_series_for_the_linger_unless_it_runs_again() -> None:
    clock = Clock()
    metrics = RoundMetrics(finished_job_series_s=60.0, clock=clock)
    for job in ("a", "b"):
        metrics.round_finished(RoundReport(job, "completed", "", 2, 10, 100, 100, 0.01, 0.0, 1, 0.001))
        metrics.membership_changed(job, "joined", 2)
    metrics.drop_ended(lambda: set())  # both ended now
    clock.now = 59.0
    metrics.drop_ended(lambda: {"b"})  # "b" runs again (a torchrun restart, the same job id)
    assert jobs_with_series(metrics) == {"a", "b"}
    clock.now = 61.0
    metrics.drop_ended(lambda: {"b"})
    assert jobs_with_series(metrics) == {"b"}
    metrics.drop_ended(lambda: set())
    clock.now = 120.0
    metrics.drop_ended(lambda: set())
    assert jobs_with_series(metrics) == {"b"}  # 59 s since it ended
    clock.now = 121.0
    metrics.drop_ended(lambda: set())
    assert not jobs_with_series(metrics)
