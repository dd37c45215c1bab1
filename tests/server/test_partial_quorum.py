"""--partial-quorum counts ranks, as --world-size does, on a real aggregator with two-level members."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import StartAggregator

from gradq.client import AggregationError, JobSpec, WorkerClient
from gradq.qcore import QuantConfig, Scheme
from gradq.server.policy import RoundPolicy

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def test_a_host_of_four_ranks_meets_a_quorum_of_four_ranks(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(RoundPolicy(world_size=8, round_timeout_s=0.5, partial_quorum=4))
    address = f"127.0.0.1:{server.port}"
    # Two hosts of four ranks each: the members are hosts, the quorum counts their ranks.
    # A 5 s call timeout: the round must close at its 0.5 s deadline, not wait for host 1, which never pushes.
    hosts = [
        WorkerClient(address, "hosts", host, JobSpec(world_size=2, ranks=4, job_ranks=8), EXACT, timeout_s=5)
        for host in (0, 1)
    ]
    try:
        for host in hosts:
            host.join()
        mean = hosts[0].push_pull(0, 0, np.full(4, 8.0, np.float32))  # the sum of the host's four ranks
        np.testing.assert_allclose(mean, np.full(4, 2.0))  # over the four ranks that pushed, at the deadline
        assert hosts[0].stats().partial_rounds == 1
    finally:
        for host in hosts:
            host.close()


def test_a_job_with_fewer_ranks_than_the_quorum_is_refused_naming_both(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=1.0, partial_quorum=4))
    client = WorkerClient(f"127.0.0.1:{server.port}", "small", 0, 2, EXACT, timeout_s=5)
    try:
        with pytest.raises(AggregationError, match=r"job_ranks=2 is below gradq serve --partial-quorum=4"):
            client.join()
        assert server.table.active_jobs() == {}  # refused before anything was held
    finally:
        client.close()
