"""Half-precision buckets are compared with what they weigh in their own dtype, by the worker and by /metrics."""

from __future__ import annotations

import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from gradq.client import WorkerClient
from gradq.qcore import QuantConfig, wire_size
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy


def test_a_float16_bucket_is_compared_with_two_bytes_per_element() -> None:
    server = AggregatorServer(RoundPolicy(round_timeout_s=5.0), ServerOptions("127.0.0.1:0", metrics_port=0))
    server.start()
    config, numel, pushes = QuantConfig(bits=8), 4096, 3
    try:
        with WorkerClient(f"127.0.0.1:{server.port}", "half", 0, 1, config) as client:
            for step in range(pushes):
                client.push_pull(step, 0, np.random.default_rng(step).normal(size=numel).astype(np.float16))
            stats = client.stats()
        assert server.metrics_port is not None
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    finally:
        server.stop()
    assert stats.dtype == "float16" and stats.uncompressed_bytes == pushes * 2 * numel
    assert stats.compression_ratio == 2 * numel / wire_size(numel, config)  # about 1.9x, not the 3.9x of fp32
    assert "x vs float16 " in stats.line()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("gradq_uncompressed_bytes_total", (("dtype", "float16"), ("job", "half")))] == pushes * 2 * numel
    assert samples[("gradq_compression_ratio", (("job", "half"),))] == 2 * numel / wire_size(numel, config)
