"""The aggregator's side of FSDP jobs: a host's ranks join as one member, each pushing its own shard's key.

use_gradq joins every rank of host h as member h, standing for one replica
(job_ranks = hosts), and rank j of the host pushes its shard of unit u under
key ``u * L + j``. These tests drive that membership with real clients on a
real server: full rounds are the mean over hosts, and a partial round (a host
silent at the deadline) is the mean over the hosts that pushed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gradq.client import JobSpec
from gradq.client.worker import WorkerClient
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

HOSTS, LOCAL = 3, 2
NUMEL = 2048


@pytest.fixture(scope="module")
def aggregator() -> Iterator[AggregatorServer]:
    policy = RoundPolicy(round_timeout_s=1.0, partial_quorum=2, server_error_feedback=False)
    server = AggregatorServer(policy, ServerOptions("127.0.0.1:0"))
    server.start()
    yield server
    server.stop()


def shard_clients(server: AggregatorServer, job_id: str) -> list[list[WorkerClient]]:
    """clients[host][local_rank], joined as use_gradq joins them."""
    clients = [
        [
            WorkerClient(
                f"127.0.0.1:{server.port}",
                job_id,
                host,
                JobSpec(world_size=HOSTS, ranks=1, job_ranks=HOSTS),
                QuantConfig(bits=8),
            )
            for _ in range(LOCAL)
        ]
        for host in range(HOSTS)
    ]
    for host in clients:
        for client in host:
            client.join()
    return clients


def shards(step: int) -> np.ndarray:
    """shards[host, local_rank]: the reduce-scattered shard each rank holds at ``step``."""
    return np.random.default_rng(step).normal(size=(HOSTS, LOCAL, NUMEL)).astype(np.float32)


def push(clients: list[list[WorkerClient]], step: int, hosts: range) -> dict[tuple[int, int], np.ndarray]:
    values = shards(step)
    futures = {
        (host, local): clients[host][local].push_pull_async(step, local, values[host, local])
        for host in hosts
        for local in range(LOCAL)
    }
    return {place: future.result(timeout=30) for place, future in futures.items()}


def test_a_full_round_is_the_mean_over_hosts_for_each_shard(aggregator: AggregatorServer) -> None:
    clients = shard_clients(aggregator, "fsdp-full")
    means = push(clients, 0, range(HOSTS))
    values = shards(0)
    for (_, local), mean in means.items():
        want = values[:, local].mean(axis=0)  # over hosts, never over a host's shards
        assert np.abs(mean - want).max() <= 2 * np.abs(values[:, local]).max() / 255
        assert np.array_equal(mean, means[(0, local)])  # every host gets the same mean
    for on_host in clients:
        for client in on_host:
            client.close()


def test_a_partial_round_is_the_mean_over_the_hosts_that_pushed(aggregator: AggregatorServer) -> None:
    clients = shard_clients(aggregator, "fsdp-partial")
    means = push(clients, 0, range(2))  # host 2 stays silent past the deadline
    values = shards(0)
    for (host, local), mean in means.items():
        want = values[:2, local].mean(axis=0)  # divided by the 2 hosts present, not by all 3
        assert np.abs(mean - want).max() <= 2 * np.abs(values[:2, local]).max() / 255, (host, local)
    assert clients[0][0].stats().partial_rounds >= 1
    for on_host in clients:
        for client in on_host:
            client.close()
