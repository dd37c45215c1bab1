"""What a real aggregator's /metrics says about one job, for tests that count its bytes."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from gradq.server.app import AggregatorServer


def received_bytes(server: AggregatorServer, job_id: str) -> float:
    """The wire bytes of ``job_id``'s contributions the aggregator accepted (gradq_received_bytes_total)."""
    assert server.metrics_port is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gradq_received_bytes_total" and sample.labels.get("job") == job_id:
                return sample.value
    raise AssertionError(f"no gradq_received_bytes_total for job {job_id!r}")
