"""DiLoCo's outer step on a real aggregator: seeding, the step every round takes, donor-free joins, refusals."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import StartAggregator
from outer_hosts import STEP, Host, joiner_of
from waiting import wait_until

from gradq.client import AggregationError, WorkerClient
from gradq.client.elastic import ANY_RANK
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore.outer_step import OuterStep, take_outer_step
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.budget import MemoryAccount, MemoryBudget
from gradq.server.errors import FailedPreconditionError, InvalidArgumentError
from gradq.server.limits import ServiceLimits
from gradq.server.outer_service import AGGREGATOR_SENDER
from gradq.server.outer_state import KEY_ENTRY_BYTES, OuterState
from gradq.server.policy import RoundPolicy
from gradq.server.state_relay import RELAY_BYTES


def values(seed: int, size: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=size).astype(np.float32)


# -- the state itself ------------------------------------------------------------------------------


def test_the_state_moves_by_the_outer_step_and_is_whole_once_every_key_has() -> None:
    state = OuterState(STEP)
    assert state.seed(0, 2, 0, values(0), None, "job").matched
    assert state.seed(1, 2, 0, values(1, 10), None, "job").matched
    assert state.snapshot(1) is None and state.snapshot(0) is not None
    parameters, momentum = values(0), np.zeros(1000, np.float32)
    take_outer_step(parameters, momentum, values(2), STEP)
    assert not state.advance(0, 0, values(2), "job")  # key 1 is still before round 0
    assert not state.advance(0, 0, values(2), "job")  # a second mean for the same round moves nothing
    assert state.advance(1, 0, values(3, 10), "job")
    snapshot = np.frombuffer(state.snapshot(1) or b"", dtype="<f4")
    np.testing.assert_array_equal(snapshot[:1000], parameters)  # key 0's parameters first, then key 1's ...
    np.testing.assert_array_equal(snapshot[1010:2010], momentum)  # ... then the momenta in the same order


def test_a_seed_is_compared_with_the_copy_held_and_a_later_round_replaces_it() -> None:
    state = OuterState(STEP)
    state.seed(0, 1, 3, values(0), values(1), "job")
    assert state.seed(0, 1, 3, values(0), values(1), "job").matched
    other = state.seed(0, 1, 3, values(5), None, "job")
    assert not other.matched and other.held is not None
    np.testing.assert_array_equal(np.frombuffer(other.held[0], dtype="<f4"), values(0))  # the job's, to adopt
    assert state.seed(0, 1, 5, values(7), None, "job").matched  # a resumed checkpoint's round 5 is the job's now
    assert state.seed(0, 1, 5, values(7), None, "job").matched
    older = state.seed(0, 1, 4, values(7), None, "job")  # an older round never replaces it: the job is at 5
    assert (older.matched, older.step, older.held) == (False, 5, None)


def test_bad_seeds_are_refused_naming_the_field() -> None:
    state = OuterState(STEP)
    with pytest.raises(InvalidArgumentError, match="keys=0 is invalid"):
        state.seed(0, 0, 0, values(0), None, "job 'j'")
    with pytest.raises(InvalidArgumentError, match="momentum holds 10 elements, parameters 1000"):
        state.seed(0, 2, 0, values(0), values(1, 10), "job 'j'")
    state.seed(0, 2, 0, values(0), None, "job 'j'")
    with pytest.raises(FailedPreconditionError, match="keys=3 does not match job 'j', whose outer rounds hold 2"):
        state.seed(1, 3, 0, values(0), None, "job 'j'")
    with pytest.raises(FailedPreconditionError, match="a seed of key 0 holds 10 elements; expected 1000, the size of"):
        state.seed(0, 2, 0, values(0, 10), None, "job 'j'")
    chunk = 3 + (1 << 32)  # a shard holds a sparse set of round keys (a bucket's chunks): any key, up to ``keys``
    assert state.seed(chunk, 2, 0, values(0), None, "job 'j'").matched
    with pytest.raises(FailedPreconditionError, match="a seed of round key 9 is one too many for job 'j', whose outer"):
        state.seed(9, 2, 0, values(0), None, "job 'j'")
    with pytest.raises(FailedPreconditionError, match="a push of round key 9 is one too many for job 'j'"):
        state.check_push(9, 0, 1000, True, "job 'j'", MemoryBudget(1 << 30), MemoryAccount("job 'j'", 1 << 30))


# -- on a real aggregator --------------------------------------------------------------------------


@pytest.fixture
def server(start_aggregator: StartAggregator) -> AggregatorServer:
    return start_aggregator(RoundPolicy(round_timeout_s=20.0))


@pytest.fixture
def host(server: AggregatorServer) -> Iterator[Host]:
    clients: list[WorkerClient] = []
    yield joiner_of(server.port, clients)
    for client in clients:
        client.close()


def test_the_aggregator_steps_the_global_state_and_a_joiner_receives_it_with_no_donor(
    host: Host, server: AggregatorServer
) -> None:
    first, second = host(), host()
    start = values(0)
    assert first.membership.seed_outer(0, 0, 1, start, None)[0]
    assert second.membership.seed_outer(0, 0, 1, start, None)[0]  # the same copy: matched
    joiner = host()
    assert joiner.membership.catch_up
    fetched = ThreadPoolExecutor(1).submit(joiner.membership.fetch_state)
    wait_until(lambda: server.table.budget.in_use >= RELAY_BYTES, "the joiner to wait for the state", 5.0)
    pseudo = [values(1), values(2)]
    with ThreadPoolExecutor(2) as pool:
        means = [pool.submit(c.push_pull, 0, 0, p) for c, p in zip((first, second), pseudo, strict=True)]
        mean = means[0].result(timeout=10)
        np.testing.assert_array_equal(mean, means[1].result(timeout=10))
    (received,) = fetched.result(timeout=10)  # at the boundary the round made, from the aggregator itself
    parameters, momentum = start.copy(), np.zeros_like(start)
    take_outer_step(parameters, momentum, mean, STEP)  # what every host does with the mean
    state = np.frombuffer(received.data, dtype="<f4")
    assert (received.step, received.sender) == (1, AGGREGATOR_SENDER)
    np.testing.assert_array_equal(state[:1000], parameters)
    np.testing.assert_array_equal(state[1000:], momentum)
    # The joiner is a member from round 1 on: that round waits for it, and every host's copy is the aggregator's.
    with ThreadPoolExecutor(3) as pool:
        means = [pool.submit(c.push_pull, 1, 0, values(3)) for c in (first, second, joiner)]
        mean = means[0].result(timeout=10)
        assert all(np.array_equal(m.result(timeout=10), mean) for m in means)
    np.testing.assert_allclose(mean, values(3), rtol=1e-6)
    take_outer_step(parameters, momentum, mean, STEP)
    assert all(c.membership.seed_outer(2, 0, 1, parameters, momentum)[0] for c in (first, second, joiner))
    # A host whose copy differs is told, and handed the job's.
    matched, step, theirs, _ = first.membership.seed_outer(2, 0, 1, values(9), momentum)
    assert not matched and step == 2
    np.testing.assert_array_equal(np.frombuffer(theirs, dtype="<f4"), parameters)


def test_every_host_must_name_the_same_outer_step(host: Host, server: AggregatorServer) -> None:
    host()
    with pytest.raises(
        AggregationError,
        match=r"FAILED_PRECONDITION: outer_step lr=0.5 momentum=0.9 nesterov=True "
        r"does not match job 'd' .* whose outer step is lr=0.7 momentum=0.9 nesterov=True",
    ):
        host(OuterStep(lr=0.5))
    with pytest.raises(AggregationError, match=r"outer_step none .* does not match"):
        host(None)
    plain = host(None, job="averaging")
    with pytest.raises(AggregationError, match=r"FAILED_PRECONDITION: .* has no outer step on the aggregator"):
        plain.membership.seed_outer(0, 0, 1, values(0), None)


def test_bad_outer_requests_are_refused_naming_the_field(server: AggregatorServer) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.AggregatorStub(channel)
    fixed = pb.JoinRequest(job_id="f", rank=0, world_size=1, outer_step=pb.OuterStep(lr=0.7, momentum=0.9))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Join(fixed)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outer_step (lr=0.7 momentum=0.9 nesterov=False) is only valid in an elastic Join" in refused.value.details()
    for lr, momentum, expected in ((-1.0, 0.9, "outer_step.lr=-1.0 is invalid"), (0.7, 1.0, "momentum=1.0")):
        request = pb.JoinRequest(
            job_id="e", rank=ANY_RANK, world_size=1, elastic=True, outer_step=pb.OuterStep(lr=lr, momentum=momentum)
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in refused.value.details()
    joined = stub.Join(
        pb.JoinRequest(job_id="e", rank=ANY_RANK, world_size=1, elastic=True, outer_step=pb.OuterStep(lr=1))
    )
    seed = pb.OuterSeed(job_id="e", rank=joined.rank, incarnation=joined.incarnation, keys=1, parameters=b"1234567")
    with pytest.raises(grpc.RpcError) as refused:
        stub.SeedOuter(seed)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters holds 7 bytes; expected float32 values" in refused.value.details()
    stranger = pb.OuterSeed(job_id="e", rank=5, incarnation=joined.incarnation, keys=1, parameters=bytes(8))
    with pytest.raises(grpc.RpcError) as refused:
        stub.SeedOuter(stranger)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank=5 has not joined" in refused.value.details()
    channel.close()


def test_a_seed_past_the_memory_budget_is_refused_and_holds_nothing() -> None:
    limits = ServiceLimits(max_memory_bytes=1 << 20)  # a job may hold a quarter of it
    server = AggregatorServer(RoundPolicy(round_timeout_s=20.0), ServerOptions("127.0.0.1:0", grace_s=1.0), limits)
    server.start()
    clients: list[WorkerClient] = []
    join = joiner_of(server.port, clients)
    try:
        first = join(hosts=1)
        held = server.table.budget.in_use
        with pytest.raises(AggregationError, match="RESOURCE_EXHAUSTED"):
            first.membership.seed_outer(0, 0, 1, np.zeros(1 << 18, np.float32), None)  # 2 MiB with its momentum
        assert server.table.budget.in_use == held
        assert first.membership.seed_outer(0, 0, 1, np.zeros(1 << 14, np.float32), None)[0]  # 128 KiB fits
        assert server.table.budget.in_use == held + 2 * (1 << 16) + KEY_ENTRY_BYTES
        for client in clients:
            client.close()
        assert server.table.budget.in_use == 0  # the job ended: its global state is given back
    finally:
        server.stop()
