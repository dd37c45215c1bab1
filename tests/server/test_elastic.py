"""Elastic jobs on a real aggregator: member ids, pending joiners, the state relay, losses, and who may do what."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import StartAggregator
from waiting import wait_until

from gradq.client import AggregationError, JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK, JobWorld
from gradq.client.security import ChannelSecurity
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer
from gradq.server.auth import TokenScope, TokenTable
from gradq.server.policy import RoundPolicy
from gradq.server.state_relay import RELAY_BYTES, Relay

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
Host = Callable[..., WorkerClient]


@pytest.fixture
def server(start_aggregator: StartAggregator) -> AggregatorServer:
    return start_aggregator(RoundPolicy(round_timeout_s=20.0))


@pytest.fixture
def host(server: AggregatorServer) -> Iterator[Host]:
    """Joined elastic members of job 'e' (2 starting hosts); each closed at teardown."""
    clients: list[WorkerClient] = []

    def join(incarnation: str = "", **spec: object) -> WorkerClient:
        client = WorkerClient(
            f"127.0.0.1:{server.port}",
            "e",
            ANY_RANK,
            JobSpec(world_size=2, elastic=True, **spec),  # type: ignore[arg-type]
            EXACT,
            timeout_s=20,
            incarnation=incarnation or f"run-{len(clients)}",
        )
        clients.append(client)
        client.join()
        return client

    yield join
    for client in clients:
        client.close()


def wait_for_world(client: WorkerClient, done: Callable[[JobWorld], bool], timeout_s: float = 5.0) -> JobWorld:
    wait_until(
        lambda: client.membership.world is not None and done(client.membership.world),
        "the Watch stream to announce it",
        timeout_s,
    )
    assert client.membership.world is not None
    return client.membership.world


def test_members_get_the_lowest_free_ids_and_the_live_runs_incarnation(host: Host) -> None:
    first, second = host("a"), host("b")
    assert (first.membership.rank, second.membership.rank) == (0, 1)
    assert first.membership.incarnation == second.membership.incarnation == "a"  # joined, not superseded
    assert not first.membership.catch_up and not second.membership.catch_up  # the starting hosts
    third = host("c")
    assert (third.membership.rank, third.membership.incarnation, third.membership.catch_up) == (2, "a", True)
    with pytest.raises(AggregationError, match=r"FAILED_PRECONDITION: member 2 of elastic .* is pending"):
        third.push_pull(0, 0, np.ones(4, np.float32))
    world = wait_for_world(first, lambda world: world.size == 2)
    assert (world.members, world.ranks) == ((0, 1), 2)


def test_elastic_max_hosts_caps_the_job_and_every_host_must_say_the_same_cap(host: Host) -> None:
    members = [host(max_members=3) for _ in range(3)]  # 2 start the job, a third joins: the cap is 3
    with pytest.raises(
        AggregationError,
        match=r"FAILED_PRECONDITION: elastic .* holds 3 hosts, its most "
        r"\(elastic_max_hosts=3\)",
    ):
        host(max_members=3)
    with pytest.raises(AggregationError, match=r"elastic_max_hosts=5 does not match .* holds at most 3 hosts"):
        host(max_members=5)
    assert [member.membership.rank for member in members] == [0, 1, 2]  # the refusals left the members alone
    members[2].close()  # one leaves: a host may take its place
    wait_for_world(members[0], lambda world: 2 not in world.members)
    assert host(max_members=3).membership.rank == 2


def test_a_host_whose_model_differs_is_refused_naming_the_first_difference(host: Host) -> None:
    model = "0.fc.weight float32[64, 32]\n0.fc.bias float32[64]"
    first, second = host(model_signature=model), host(model_signature=model)  # the first Join fixes the job's
    with pytest.raises(
        AggregationError,
        match=r"FAILED_PRECONDITION: this host's model differs from .* at tensor 0: "
        r"this host has '0.fc.weight float32\[32, 64\]', the job '0.fc.weight float32\[64, 32\]'",
    ):
        host(model_signature="0.fc.weight float32[32, 64]\n0.fc.bias float32[64]")
    with pytest.raises(
        AggregationError,
        match=r"at tensor 2: this host has '0.head.weight float32\[10\]', the job "
        r"nothing \(its model ends after 2 tensors\)",
    ):
        host(model_signature=model + "\n0.head.weight float32[10]")
    # The right model still joins (pending: it waits for the state).
    assert host(model_signature=model).membership.catch_up
    with ThreadPoolExecutor(2) as pool:  # and the starting hosts train on
        means = list(pool.map(lambda client: client.push_pull(0, 0, np.ones(4, np.float32)), (first, second)))
    assert all(np.allclose(mean, 1.0) for mean in means)


def test_elastic_and_fixed_joins_do_not_mix(host: Host, server: AggregatorServer) -> None:
    host()
    with pytest.raises(AggregationError, match=r"FAILED_PRECONDITION: elastic=False does not match .* elastic"):
        WorkerClient(f"127.0.0.1:{server.port}", "e", 0, 2, EXACT, timeout_s=5).join()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    starting = {"job_id": "e2", "rank": ANY_RANK, "world_size": 2, "elastic": True, "training_members": 1}
    try:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.AggregatorStub(channel).Join(pb.JoinRequest(job_id="fixed", rank=ANY_RANK, world_size=2), timeout=5)
        with pytest.raises(grpc.RpcError) as claimed:  # only a member that trained says who was training
            pb_grpc.AggregatorStub(channel).Join(pb.JoinRequest(**starting), timeout=5)  # type: ignore[arg-type]
    finally:
        channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank=4294967295 (any) is only valid in an elastic Join" in (refused.value.details() or "")
    assert claimed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "training_members=1 is invalid; expected 0, or 1..1024 (--max-world-size) from a RESUMING member" in (
        claimed.value.details() or ""
    )


def test_a_lost_member_is_dropped_and_the_open_round_finishes_over_the_rest(
    host: Host, server: AggregatorServer
) -> None:
    first, second = host(), host()
    ones = np.ones(8, np.float32)
    with ThreadPoolExecutor(2) as pool:
        both = [pool.submit(client.push_pull, 0, 0, ones * (client.membership.rank + 1)) for client in (first, second)]
        assert [f.result(timeout=10).tolist() for f in both] == [[1.5] * 8] * 2
    waiting = ThreadPoolExecutor(1).submit(first.push_pull, 1, 0, ones)
    wait_until(lambda: server.table.in_flight() == 1, "member 0's push to open step 1's round")
    assert not waiting.done()
    second.membership._watches[0].cancel()  # its Watch ends without a Leave: the aggregator takes it for lost
    # The mean over the one member left, at the loss: well before the round's 20 s deadline.
    assert waiting.result(timeout=5).tolist() == [1.0] * 8
    world = wait_for_world(first, lambda world: world.size == 1)
    assert world.members == (0,) and world.ranks == 1


def test_a_joiner_receives_the_state_relayed_and_trains_from_that_step(host: Host, server: AggregatorServer) -> None:
    first, second = host(), host()
    state = np.random.default_rng(0).bytes(3 * (1 << 20) + 12345)  # several relay chunks
    joiner = host()
    assert joiner.membership.catch_up
    fetched = ThreadPoolExecutor(1).submit(joiner.membership.fetch_state)
    world = wait_for_world(first, lambda world: world.joiners == (2,))
    assert world.donor == 0 and world.members == (0, 1)
    # While it waits, the relay is charged to the job: the aggregator's budget holds it.
    assert server.table.budget.in_use >= RELAY_BYTES
    assert first.membership.send_state(2, 7, state) == len(state)
    (received,) = fetched.result(timeout=10)
    assert (received.data, received.step, received.sender) == (state, 7, 0)
    assert not joiner.membership.catch_up
    assert wait_for_world(second, lambda world: world.size == 3).ranks == 3
    # Step 7 now waits for all three; each gets the same mean.
    with ThreadPoolExecutor(3) as pool:
        means = [
            pool.submit(c.push_pull, 7, 0, np.full(4, c.membership.rank, np.float32)) for c in (first, second, joiner)
        ]
        assert [m.result(timeout=10).tolist() for m in means] == [[1.0] * 4] * 3
    assert server.table.budget.in_use < RELAY_BYTES  # the relay's charge is given back


def relays(server: AggregatorServer) -> list[Relay]:
    """The state relays the aggregator holds now (claimed by a donor or not)."""
    return list(server.servicer.relays._relays.values())


def test_the_relay_holds_back_a_sender_until_the_joiner_reads(host: Host, server: AggregatorServer) -> None:
    first, _ = host(), host()
    joiner = host()
    stub = pb_grpc.AggregatorStub(grpc.insecure_channel(joiner.addresses[0]))
    request = pb.StateRequest(job_id="e", rank=joiner.membership.rank, incarnation=joiner.membership.incarnation)
    stream = stub.FetchState(request, timeout=30)
    wait_for_world(first, lambda world: world.joiners == (2,))
    state = bytes(64 << 20)  # far more than the relay (4 MiB) and HTTP/2's windows hold
    sending: Future[int] = ThreadPoolExecutor(1).submit(first.membership.send_state, 2, 3, state)
    wait_until(lambda: [relay.queue.full() for relay in relays(server)] == [True], "the relay's queue full")
    assert not sending.done()  # held back: the aggregator does not buffer what the joiner has not read
    assert relays(server)[0].relayed < len(state)  # stopped partway, not merely slow to report
    assert sum(len(chunk.data) for chunk in stream) == len(state)
    assert sending.result(timeout=10) == len(state)


def test_a_sender_that_goes_away_leaves_the_joiner_to_join_again_and_take_the_state_from_another(
    host: Host, server: AggregatorServer
) -> None:
    first, second = host(), host()
    joiner = host()
    fetched = ThreadPoolExecutor(1).submit(joiner.membership.fetch_state)
    wait_for_world(first, lambda world: world.joiners == (2,))
    header = pb.StateChunk(
        job_id="e", rank=0, incarnation=first.membership.incarnation, joiner=2, step=1, total_bytes=10 << 20
    )
    cancelled = threading.Event()

    def half_then_stop() -> Iterator[pb.StateChunk]:
        first_chunk = pb.StateChunk()
        first_chunk.CopyFrom(header)
        first_chunk.data = bytes(1 << 20)
        yield first_chunk
        cancelled.wait(30)  # a sender that stalls mid-transfer, until the test cancels its call

    stub = pb_grpc.AggregatorStub(grpc.insecure_channel(first.addresses[0]))
    call = stub.PutState.future(half_then_stop(), timeout=30)
    wait_until(lambda: any(relay.relayed for relay in relays(server)), "the first chunk relayed to the joiner")
    call.cancel()  # member 0 stops sending mid-transfer: the joiner's transfer breaks (UNAVAILABLE)
    cancelled.set()
    # It leaves, joins again as a newcomer and waits for a sender again; the other live member sends.
    wait_until(lambda: joiner.membership.joins >= 2, "the joiner to join again", 10.0)
    wait_for_world(second, lambda world: world.joiners == (joiner.membership.rank,))
    assert second.membership.send_state(joiner.membership.rank, 4, b"the training state") == len(b"the training state")
    (received,) = fetched.result(timeout=10)
    assert (received.data, received.step, received.sender) == (b"the training state", 4, second.membership.rank)


def test_only_a_pending_member_fetches_and_only_a_training_member_sends(host: Host) -> None:
    first, _ = host(), host()
    with pytest.raises(AggregationError, match=r"FAILED_PRECONDITION: .*member 0 .* trains already"):
        first.membership.fetch_state()
    with pytest.raises(
        AggregationError, match=r"FAILED_PRECONDITION: sending the training state: member 5 of .* is not waiting"
    ):
        first.membership.send_state(5, 1, b"x")
    joiner = host()
    ThreadPoolExecutor(1).submit(joiner.membership.fetch_state)
    wait_for_world(first, lambda world: world.joiners == (2,))
    with pytest.raises(
        AggregationError, match=r"FAILED_PRECONDITION: sending the training state: member 2 of elastic .* is pending"
    ):
        joiner.membership.send_state(2, 1, b"x")  # a pending member cannot admit itself
    with pytest.raises(AggregationError, match=r"INVALID_ARGUMENT: the state ended at 1 of its total_bytes=2"):
        header = pb.StateChunk(
            job_id="e", rank=0, incarnation=first.membership.incarnation, joiner=2, step=1, total_bytes=2
        )
        header.data = b"x"
        stub = pb_grpc.AggregatorStub(grpc.insecure_channel(first.addresses[0]))
        try:
            stub.PutState(iter([header]), timeout=5)
        except grpc.RpcError as error:
            raise AggregationError("server", error.code(), error.details() or "") from None


def test_a_members_newer_fetch_replaces_the_one_it_gave_up_on_and_its_charge_counts_once(
    host: Host, server: AggregatorServer
) -> None:
    first, _ = host(), host()
    joiner = host()
    before = server.table.budget.in_use
    stub = pb_grpc.AggregatorStub(grpc.insecure_channel(joiner.addresses[0]))
    request = pb.StateRequest(job_id="e", rank=joiner.membership.rank, incarnation=joiner.membership.incarnation)
    # The member's first FetchState is still open on the server when its next one comes: the order a client
    # that gave up on a call (its deadline, or a broken transfer and a new Join) reaches under load.
    abandoned = stub.FetchState(request, timeout=30)
    wait_until(lambda: len(relays(server)) == 1, "the first FetchState to wait")
    stale = relays(server)[0]
    fetched = ThreadPoolExecutor(1).submit(joiner.membership.fetch_state)
    wait_until(lambda: relays(server) not in ([], [stale]), "the second FetchState to take the first's place")
    with pytest.raises(grpc.RpcError) as ended:
        list(abandoned)
    assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert re.search(r"member 2 of .* asked for the state again", ended.value.details() or "")
    assert stale.closed and len(relays(server)) == 1
    assert server.table.budget.in_use - before == RELAY_BYTES  # one member waits: one charge, not two
    assert wait_for_world(first, lambda world: world.joiners == (2,)).joiners == (2,)
    assert first.membership.send_state(2, 5, b"the training state") == len(b"the training state")
    (received,) = fetched.result(timeout=10)
    assert (received.data, received.step, received.sender) == (b"the training state", 5, 0)
    wait_until(lambda: server.table.budget.in_use == before, "the relay's one charge to be given back")


def test_tokens_scope_elastic_joins_fetches_and_sends(start_aggregator: StartAggregator) -> None:
    tokens = {
        "team-a-token-000000": TokenScope(job="team-a*"),
        "team-b-token-000000": TokenScope(job="team-b*"),
        "team-a-rank-3-token": TokenScope(job="team-a*", rank=3),
    }
    server = start_aggregator(RoundPolicy(round_timeout_s=20.0), tokens=TokenTable(tokens))
    address = f"127.0.0.1:{server.port}"

    def member(token: str, job: str = "team-a-1") -> WorkerClient:
        security = ChannelSecurity(token=token)
        return WorkerClient(
            address, job, ANY_RANK, JobSpec(world_size=1, elastic=True), EXACT, timeout_s=10, security=security
        )

    owner = member("team-a-token-000000")
    owner.join()
    try:
        intruder = member("team-b-token-000000")
        with pytest.raises(AggregationError, match=r"PERMISSION_DENIED: this token is bound to jobs starting with"):
            intruder.join()
        intruder.membership.rank, intruder.membership.incarnation = 1, owner.membership.incarnation
        with pytest.raises(AggregationError, match=r"PERMISSION_DENIED"):
            intruder.membership.fetch_state()
        with pytest.raises(AggregationError, match=r"PERMISSION_DENIED"):
            intruder.membership.send_state(1, 1, b"x")
        bound = member("team-a-rank-3-token")
        bound.join()  # asks for any member id; its token makes it member 3
        assert (bound.membership.rank, bound.membership.catch_up) == (3, True)
        bound.close()
        intruder.close()
    finally:
        owner.close()


def test_membership_changes_are_counted_in_the_metrics(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=20.0), metrics_port=0)
    assert server.metrics_port is not None
    address = f"127.0.0.1:{server.port}"
    members = [
        WorkerClient(address, "m", ANY_RANK, JobSpec(world_size=2, elastic=True), EXACT, timeout_s=10) for _ in range(3)
    ]
    for member in members:
        member.join()
    members[1].membership._watches[0].cancel()  # lost
    port = server.metrics_port
    counts = wait_until(lambda: (found := _membership(port)).get("rank_lost", 0) >= 1 and found, "the loss counted")
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as answer:
        members_training = answer.read().decode()
    for member in members:
        member.close()
    assert counts == {"joined": 2, "pending": 1, "rank_lost": 1}
    assert 'gradq_job_members{job="m"} 1.0' in members_training


def _membership(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.findall(r'gradq_membership_events_total\{event="(\w+)",job="m"\} ([0-9.]+)', text)
    found += re.findall(r'gradq_membership_events_total\{job="m",event="(\w+)"\} ([0-9.]+)', text)
    return {event: int(float(count)) for event, count in found}


def test_every_host_of_an_elastic_job_holds_as_many_ranks(host: Host) -> None:
    host(ranks=2)
    with pytest.raises(AggregationError, match=r"FAILED_PRECONDITION: ranks=1 does not match elastic .* hold 2 ranks"):
        host(ranks=1)
