"""Semi-synchronous rounds on a real aggregator: a quorum and a grace window close them; late pushes are merged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import StartAggregator
from waiting import wait_until

from gradq.client import AggregationError, JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme
from gradq.qcore.outer_step import OuterStep, take_outer_step
from gradq.server.app import AggregatorServer
from gradq.server.outer_service import AGGREGATOR_SENDER
from gradq.server.policy import RoundPolicy
from gradq.server.state_relay import RELAY_BYTES

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
STEP = OuterStep()
Host = Callable[..., WorkerClient]


@pytest.fixture
def server(start_aggregator: StartAggregator) -> AggregatorServer:
    return start_aggregator(RoundPolicy(round_timeout_s=20.0))


@pytest.fixture
def host(server: AggregatorServer) -> Iterator[Host]:
    clients: list[WorkerClient] = []

    def join(semi_sync: tuple[int, float] | None = (2, 0.2)) -> WorkerClient:
        client = WorkerClient(
            f"127.0.0.1:{server.port}",
            "s",
            ANY_RANK,
            JobSpec(world_size=3, elastic=True, outer_step=STEP, semi_sync=semi_sync),
            EXACT,
            timeout_s=20,
        )
        clients.append(client)
        client.join()
        return client

    yield join
    for client in clients:
        client.close()


def ones(value: float) -> np.ndarray:
    return np.full(256, value, np.float32)


def test_a_round_closes_on_its_quorum_and_the_late_push_is_merged_into_the_next(
    host: Host, server: AggregatorServer
) -> None:
    members = [host(), host(), host()]
    start = ones(0.0)
    for member in members:
        assert member.membership.seed_outer(0, 0, 1, start, None)[0]
    fast, slow = members[:2], members[2]
    with ThreadPoolExecutor(2) as pool:  # the third does not push: the round waits the grace window, no more
        means = [pool.submit(m.push_pull, 0, 0, ones(1.0 + m.membership.rank)) for m in fast]
        assert [f.result(timeout=5).tolist() for f in means] == [[1.5] * 256] * 2
    held = server.table.budget.in_use
    with pytest.raises(AggregationError, match=r"FAILED_PRECONDITION: member 2 was late for round .*step=0"):
        slow.push_pull(0, 0, ones(9.0))
    assert server.table.budget.in_use == held + 256 * 4  # its push waits in the key's late stash
    fetched = ThreadPoolExecutor(1).submit(slow.membership.fetch_state)  # pending: the next boundary sends it the state
    wait_until(lambda: server.table.budget.in_use >= held + RELAY_BYTES, "the late host to wait for the state", 5.0)
    with ThreadPoolExecutor(2) as pool:  # round 1 no longer waits for it, and counts its late push as a member's
        means = [pool.submit(m.push_pull, 1, 0, ones(3.0)) for m in fast]
        assert [f.result(timeout=5).tolist() for f in means] == [[5.0] * 256] * 2  # (3 + 3 + 9) / 3
    assert not any(job.late for job in server.table.jobs.all())  # merged: the stash and its charge are gone
    parameters, momentum = start.copy(), np.zeros_like(start)
    take_outer_step(parameters, momentum, ones(1.5), STEP)
    take_outer_step(parameters, momentum, ones(5.0), STEP)
    (received,) = fetched.result(timeout=5)
    assert (received.step, received.sender) == (2, AGGREGATOR_SENDER)
    np.testing.assert_array_equal(np.frombuffer(received.data, dtype="<f4")[:256], parameters)
    # Admitted at round 2: it is a member again; that round needs all three or the quorum and the grace.
    with ThreadPoolExecutor(3) as pool:
        means = [pool.submit(m.push_pull, 2, 0, ones(float(m.membership.rank))) for m in members]
        assert [f.result(timeout=5).tolist() for f in means] == [[1.0] * 256] * 3
    for member in members:
        member.close()
    assert server.table.budget.in_use == 0  # the job ended: its global state and kept rounds are given back


def test_semi_sync_settings_are_checked_and_must_agree(host: Host, server: AggregatorServer) -> None:
    host()
    with pytest.raises(AggregationError, match=r"semi_sync quorum=1 grace_s=0.2 does not match .* quorum=2"):
        host((1, 0.2))
    with pytest.raises(AggregationError, match=r"semi_sync none \(synchronous\) does not match"):
        host(None)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.AggregatorStub(channel)
    outer = pb.OuterStep(lr=1)
    cases = [
        (pb.JoinRequest(semi_sync=pb.SemiSync(quorum=1, grace_s=1)), "semi_sync (quorum=1 grace_s=1) needs outer_step"),
        (pb.JoinRequest(outer_step=outer, semi_sync=pb.SemiSync(quorum=0)), "semi_sync.quorum=0 is invalid"),
        (pb.JoinRequest(outer_step=outer, semi_sync=pb.SemiSync(quorum=1, grace_s=-1)), "grace_s=-1.0 is invalid"),
    ]
    for request, expected in cases:
        request.MergeFrom(pb.JoinRequest(job_id="t", rank=ANY_RANK, world_size=2, elastic=True))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in refused.value.details()
    channel.close()
