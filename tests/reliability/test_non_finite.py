"""NaN/Inf gradients from one worker: rejected for everyone by default, or the step skipped by everyone."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from gradq.client import AggregationError, WorkerClient
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy


@pytest.fixture(params=["reject", "skip"])
def server(request: pytest.FixtureRequest) -> Iterator[AggregatorServer]:
    aggregator = AggregatorServer(
        RoundPolicy(round_timeout_s=10.0, non_finite=request.param), ServerOptions("127.0.0.1:0", grace_s=0.5)
    )
    aggregator.start()
    yield aggregator
    aggregator.stop()


def two_ranks(address: str, poisoned_step: int) -> dict[int, list[np.ndarray | Exception]]:
    outcomes: dict[int, list[np.ndarray | Exception]] = {0: [], 1: []}

    def work(rank: int) -> None:
        with WorkerClient(address, "nan", rank, 2, QuantConfig(bits=8)) as client:
            for step in range(3):
                values = np.full(100, 2.0 * (rank + 1), np.float32)
                if rank == 1 and step == poisoned_step:
                    values[17] = np.nan
                try:
                    outcomes[rank].append(client.push_pull(step, 0, values))
                except AggregationError as error:
                    outcomes[rank].append(error)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_a_nan_bucket_is_never_averaged_silently(server: AggregatorServer) -> None:
    outcomes = two_ranks(f"127.0.0.1:{server.port}", poisoned_step=1)
    for rank in (0, 1):
        first, poisoned, after = outcomes[rank]
        np.testing.assert_array_equal(first, np.full(100, 3.0, np.float32))
        np.testing.assert_array_equal(after, np.full(100, 3.0, np.float32))
        if server.policy.non_finite == "reject":
            assert isinstance(poisoned, AggregationError)
            assert "INVALID_ARGUMENT" in str(poisoned) and "rank 1 reported NaN/Inf gradients" in str(poisoned)
        else:
            np.testing.assert_array_equal(poisoned, np.zeros(100, np.float32))
    assert server.table.counters["rounds_failed"] == (1 if server.policy.non_finite == "reject" else 0)
