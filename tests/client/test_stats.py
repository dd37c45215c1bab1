"""WorkerClient.stats(): bytes, ratio, error and time split, measured against a real aggregator."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest

from gradq.client import WorkerClient
from gradq.qcore import QuantConfig, wire_size
from gradq.server.app import AggregatorServer


@pytest.mark.parametrize("error_feedback", [False, True])
def test_stats_count_what_was_sent_and_log_one_line(
    caplog: pytest.LogCaptureFixture, start_aggregator: Callable[..., AggregatorServer], error_feedback: bool
) -> None:
    server = start_aggregator()  # round timeout 5 s
    config = QuantConfig(bits=8)
    numel, pushes = 4096, 20
    with (
        caplog.at_level(logging.INFO, logger="gradq.client.stats"),
        WorkerClient(
            f"127.0.0.1:{server.port}", "stats", 0, 1, config, error_feedback=error_feedback, log_every_s=0.0
        ) as client,
    ):
        rng = np.random.default_rng(0)
        for step in range(pushes):
            client.push_pull(step, 0, rng.normal(size=numel).astype(np.float32))
        stats = client.stats()
    assert stats.pushes == pushes
    assert stats.bytes_sent == pushes * wire_size(numel, config) == stats.bytes_received
    assert stats.uncompressed_bytes == pushes * 4 * numel and stats.dtype == "float32"
    assert 3.8 < stats.compression_ratio < 4.0
    assert 0 < stats.relative_error < 0.02
    assert stats.encode_seconds > 0 and stats.network_seconds > 0 and stats.decode_seconds > 0
    assert stats.skipped_rounds == 0 and stats.partial_rounds == 0
    lines = [record.getMessage() for record in caplog.records if record.name == "gradq.client.stats"]
    assert lines and lines[-1].startswith("gradq client pushes=") and "ratio=" in lines[-1]
