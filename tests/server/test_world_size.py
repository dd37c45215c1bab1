"""--world-size counts ranks: a Join's members stand for the job's ranks (job_ranks), checked on real servers."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from gradq.client import AggregationError, JobSpec, WorkerClient
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy

StartAggregator = Callable[..., AggregatorServer]
EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def address_of(server: AggregatorServer) -> str:
    return f"127.0.0.1:{server.port}"


def refusal(client: WorkerClient) -> AggregationError:
    """The error ``client``'s Join is refused with (it must be)."""
    try:
        with pytest.raises(AggregationError) as refused:
            client.join()
    finally:
        client.close()
    return refused.value


def test_one_host_of_two_ranks_joins_an_aggregator_of_world_size_two(start_aggregator: StartAggregator) -> None:
    # torchrun --nproc_per_node=2 under two-level aggregation: one member standing for both ranks.
    server = start_aggregator(RoundPolicy(world_size=2, round_timeout_s=5.0, return_scheme=Scheme.FLOAT32))
    with WorkerClient(address_of(server), "one-host", 0, JobSpec(world_size=1, ranks=2, job_ranks=2), EXACT) as host:
        mean = host.push_pull(0, 0, np.full(8, 6.0, np.float32))  # the host's sum over its two ranks
    np.testing.assert_array_equal(mean, np.full(8, 3.0, np.float32))


def test_a_job_of_other_ranks_than_world_size_is_a_configuration_mismatch_naming_both(
    start_aggregator: StartAggregator,
) -> None:
    server = start_aggregator(RoundPolicy(world_size=4, round_timeout_s=5.0))
    refused = refusal(
        WorkerClient(address_of(server), "one-host", 0, JobSpec(world_size=1, ranks=2, job_ranks=2), EXACT, timeout_s=5)
    )
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "configuration mismatch: this job has 2 ranks" in refused.details
    assert "1 member standing for them" in refused.details and "--world-size=4" in refused.details


def test_a_client_that_sends_no_job_ranks_counts_one_rank_per_member(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(RoundPolicy(world_size=2, round_timeout_s=5.0))
    address = address_of(server)
    with WorkerClient(address, "flat", 0, 2, EXACT), WorkerClient(address, "flat", 1, 2, EXACT):
        pass  # both joined
    refused = refusal(WorkerClient(address, "lonely", 0, 1, EXACT, timeout_s=5))
    assert "this job has 1 rank (world_size from the launcher) but gradq serve --world-size=2" in refused.details


def test_every_join_of_a_job_agrees_on_its_ranks_and_they_add_up(start_aggregator: StartAggregator) -> None:
    address = address_of(start_aggregator(RoundPolicy(round_timeout_s=5.0)))
    with WorkerClient(address, "hosts", 0, JobSpec(world_size=2, ranks=2, job_ranks=4), EXACT, timeout_s=5):
        other = refusal(
            WorkerClient(address, "hosts", 1, JobSpec(world_size=2, ranks=2, job_ranks=3), EXACT, timeout_s=5)
        )
        assert other.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "job_ranks=3 does not match" in other.details and "job_ranks=4" in other.details
        too_many = refusal(
            WorkerClient(address, "hosts", 1, JobSpec(world_size=2, ranks=3, job_ranks=4), EXACT, timeout_s=5)
        )
        assert "would stand for 5 ranks, but job_ranks=4" in too_many.details
        with WorkerClient(address, "hosts", 1, JobSpec(world_size=2, ranks=2, job_ranks=4), EXACT, timeout_s=5):
            pass  # 2 + 2 ranks: the job's 4


def test_worker_client_refuses_fewer_job_ranks_than_members() -> None:
    with pytest.raises(ValueError, match=r"job_ranks=1 is invalid; expected an integer >= world_size=2"):
        WorkerClient("127.0.0.1:1", "j", 0, JobSpec(world_size=2, job_ranks=1))
