"""Half-precision buckets are compared with what they weigh in their own dtype, by the worker and by /metrics."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from gradq.client import WorkerClient
from gradq.client.ddp import GradqHookState
from gradq.qcore import QuantConfig, wire_size
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

StartAggregator = Callable[..., AggregatorServer]  # the start_aggregator fixture (tests/conftest.py)


def test_a_float16_bucket_is_compared_with_two_bytes_per_element(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=5.0), metrics_port=0)
    config, numel, pushes = QuantConfig(bits=8), 4096, 3
    with WorkerClient(f"127.0.0.1:{server.port}", "half", 0, 1, config) as client:
        for step in range(pushes):
            client.push_pull(step, 0, np.random.default_rng(step).normal(size=numel).astype(np.float16))
        stats = client.stats()
    assert server.metrics_port is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
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


def test_a_cpu_bfloat16_bucket_copied_to_the_host_still_counts_as_bfloat16(start_aggregator: StartAggregator) -> None:
    # The numpy path pushes a float32 host copy of the bucket; the wire and /metrics must name bfloat16.
    import ddp_probe

    server = start_aggregator(RoundPolicy(round_timeout_s=30.0), metrics_port=0)
    numel, steps = 3000, 2
    rng = np.random.default_rng(5)
    gradients = [[rng.normal(0, 1e-2, numel).astype(np.float32) for _ in range(steps)] for _ in range(2)]
    state = GradqHookState(f"127.0.0.1:{server.port}", QuantConfig(bits=8), codec="numpy")
    ddp_probe.run(2, f"tcp://127.0.0.1:{free_port()}", "gradq", gradients, dtype="bfloat16", state=state)
    assert server.metrics_port is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    dtypes = {
        sample.labels.get("dtype")
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gradq_uncompressed_bytes_total"
    }
    assert dtypes == {"bfloat16"}
