"""The Prometheus endpoint, scraped over HTTP after real rounds, agrees with what the workers sent."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gradq.client import AggregationError, WorkerClient
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.metrics import RoundMetrics
from gradq.server.policy import RoundPolicy
from gradq.server.reports import RoundReport


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_match_the_rounds_that_happened() -> None:
    server = AggregatorServer(RoundPolicy(round_timeout_s=1.0), ServerOptions("127.0.0.1:0", metrics_port=0))
    server.start()
    address = f"127.0.0.1:{server.port}"
    clients = [WorkerClient(address, "m", rank, 2, QuantConfig(bits=8)) for rank in range(2)]
    try:
        rng = np.random.default_rng(0)

        def work(client: WorkerClient) -> None:
            client.join()
            for step in range(2):
                client.push_pull(step, 0, rng.normal(size=10_000).astype(np.float32))

        threads = [threading.Thread(target=work, args=(client,)) for client in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        with WorkerClient(address, "late", 0, 2) as lonely, pytest.raises(AggregationError):
            lonely.push_pull(0, 0, np.ones(10, np.float32))
        assert server.metrics_port is not None
        metrics = scrape(server.metrics_port)
    finally:
        for client in clients:
            client.close()
        server.stop()

    def value(name: str, **labels: str) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    assert value("gradq_rounds_total", job="m", outcome="completed", reason="none") == 2
    assert value("gradq_rounds_total", job="late", outcome="failed", reason="deadline") == 1
    assert value("gradq_contributions_total", job="m") == 4
    assert value("gradq_received_bytes_total", job="m") == sum(client.bytes_sent for client in clients)
    assert value("gradq_sent_bytes_total", job="m") == sum(client.bytes_received for client in clients)
    assert value("gradq_fp32_equivalent_bytes_total", job="m") == 4 * 10_000 * 4
    assert 3.8 < value("gradq_compression_ratio", job="m") < 4.0  # 8-bit: a bit under 4x with the qparams
    assert 0 < value("gradq_mean_relative_error", job="m") < 0.01
    assert value("gradq_round_seconds_count", job="m") == 2
    assert value("gradq_straggler_wait_seconds_count", job="m") == 2
    assert value("gradq_slowest_rank", job="m") in (0, 1)
    slowest = [
        value("gradq_slowest_rank_rounds_total", job="m", rank=r)
        for r in ("0", "1")
        if ("gradq_slowest_rank_rounds_total", (("job", "m"), ("rank", r))) in metrics
    ]
    assert sum(slowest) == 2


def _report(job: str, outcome: str = "completed") -> RoundReport:
    return RoundReport(job, outcome, "", 2, 10, 100, 100, 0.01, 0.0, 1, 0.001)


def _jobs_with_series(metrics: RoundMetrics) -> set[str]:
    return {
        sample.labels["job"]
        for family in metrics.registry.collect()
        for sample in family.samples
        if "job" in sample.labels
    }


def test_the_series_of_at_most_max_jobs_jobs_are_kept() -> None:
    metrics = RoundMetrics(max_jobs=2)
    for job in ("a", "b"):
        metrics.round_finished(_report(job))
    metrics.round_finished(_report("a", "failed"))  # "a" finished a round more recently than "b"
    metrics.round_finished(_report("c"))
    assert _jobs_with_series(metrics) == {"a", "c"}
    for number in range(100):  # a client inventing job ids cannot grow /metrics
        metrics.round_finished(_report(f"storm-{number}", "failed"))
    assert _jobs_with_series(metrics) == {"storm-98", "storm-99"}
