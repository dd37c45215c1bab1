"""A starting host refused for its model is a lost host: the elastic job forms with the others and trains."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import StartAggregator
from round_calls import push, wait

from gradq.client import AggregationError, WorkerClient, serde
from gradq.client.elastic import ANY_RANK
from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.job_spec import JobSpec, MemberRole
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
RIGHT = "0.fc.weight float32[64, 32]\n0.fc.bias float32[64]"
ODD = "0.fc.weight float32[32, 32]\n0.fc.bias float32[32]"


def starter(model: str, world_size: int = 3, rank: int = ANY_RANK) -> JobSpec:
    return JobSpec("vote", rank, world_size, "run", elastic=True, model_signature=model, role=MemberRole.STARTING)


def values(value: float) -> object:
    return encode(np.full(4, value, np.float32), EXACT)


def table_at(clock: list[float]) -> RoundTable:
    return RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: clock[0])


def test_the_odd_starter_joining_first_is_refused_and_the_other_two_form_the_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "gradq.server")
    clock = [0.0]
    table = table_at(clock)
    odd = table.join(starter(ODD))  # first: nobody disagrees yet, so it is answered
    assert not odd.model_undecided
    odd_ticket = push(table, "vote", 0, 0, odd.rank, values(100.0), incarnation="run")  # type: ignore[arg-type]
    first = table.join(starter(RIGHT))
    assert first.model_undecided  # its Join waits for the start quorum
    second = table.join(starter(RIGHT))  # two of three agree: the odd host is refused, the job forms without it
    assert table.vote.decided("vote", first.rank, "run")
    assert "refused members [0], each a lost host; the job formed (2 joined)" in caplog.text
    with pytest.raises(FailedPreconditionError, match="goes on without it") as refused:
        wait(table, odd_ticket)
    assert refused.value.refusal is Refusal.MODEL_MISMATCH
    tickets = [push(table, "vote", 0, 0, rank, values(v), incarnation="run") for rank, v in ((1, 1.0), (2, 5.0))]  # type: ignore[arg-type]
    assert {first.rank, second.rank} == {1, 2}
    for ticket in tickets:  # the round closed on the two that agree, with no time passing
        assert ticket.round.done.is_set()
        result = wait(table, ticket)
        assert sorted(result.contributors) == [1, 2]
    assert clock[0] == 0.0
    assert table.active_jobs() == {"vote": [1, 2]}


def test_the_odd_starter_joining_last_is_refused_at_its_join_and_the_rounds_waiting_finish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "gradq.server")
    clock = [0.0]
    table = table_at(clock)
    ranks = [table.join(starter(RIGHT, world_size=4)).rank for _ in range(3)]  # a majority of 4: model decided
    tickets = [push(table, "vote", 0, 0, rank, values(float(rank)), incarnation="run") for rank in ranks]  # type: ignore[arg-type]
    assert not any(ticket.round.done.is_set() for ticket in tickets)  # forming: they wait for the fourth
    with pytest.raises(FailedPreconditionError, match="forms without it") as refused:
        table.join(starter(ODD, world_size=4))
    assert refused.value.refusal is Refusal.MODEL_MISMATCH
    assert "for its model: the job forms without it (3 joined; formed)" in caplog.text
    result = wait(table, tickets[0])  # the round finished over the three that agree, no deadline passed
    assert sorted(result.contributors) == ranks
    assert result.encoded is not None
    assert np.allclose(decode(result.encoded), 1.0)  # (0 + 1 + 2) / 3: over the three, not four
    assert clock[0] == 0.0
    newcomer = table.join(starter(RIGHT, world_size=4))  # the job is formed: a fourth right host is a newcomer
    assert newcomer.catch_up


def test_refused_starters_never_form_a_job_with_fewer_than_a_majority() -> None:
    clock = [0.0]
    table = table_at(clock)
    ranks = [table.join(starter(RIGHT, world_size=5)).rank for _ in range(3)]  # 3 of 5: the model is decided
    table.leave("vote", ranks[2], "run")  # one of them goes before the job forms: two train, two are missing
    for _ in range(3):  # however many odd hosts come (or one asks again and again)
        with pytest.raises(FailedPreconditionError) as refused:
            table.join(starter(ODD, world_size=5))
        assert refused.value.refusal is Refusal.MODEL_MISMATCH
    ticket = push(table, "vote", 0, 0, ranks[0], values(1.0), incarnation="run")  # type: ignore[arg-type]
    push(table, "vote", 0, 0, ranks[1], values(1.0), incarnation="run")  # type: ignore[arg-type]
    assert not ticket.round.done.is_set()  # two are no majority of five: the job still forms
    third = table.join(starter(RIGHT, world_size=5))
    assert not third.catch_up  # one of the hosts it starts with, not a newcomer
    push(table, "vote", 0, 0, third.rank, values(4.0), incarnation="run")  # type: ignore[arg-type]
    result = wait(table, ticket)  # three of five with three refused: formed, and the round has them all
    assert sorted(result.contributors) == sorted([*ranks[:2], third.rank])
    assert clock[0] == 0.0


@pytest.fixture
def hosts() -> Iterator[Callable[..., WorkerClient]]:
    clients: list[WorkerClient] = []

    def make(address: str, model: str) -> WorkerClient:
        client = WorkerClient(
            [address],
            "vote",
            ANY_RANK,
            serde.JobSpec(world_size=3, elastic=True, model_signature=model),
            EXACT,
            timeout_s=20,
            retry_backoff_s=0.1,
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_three_hosts_start_together_one_with_another_model_and_the_two_right_ones_train(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient]
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=30.0))
    address = f"127.0.0.1:{server.port}"
    clients = [hosts(address, model) for model in (RIGHT, ODD, RIGHT)]

    def train(client: WorkerClient, value: float) -> object:
        try:
            client.join()
            return [client.push_pull(step, 0, np.full(4, value, np.float32)) for step in range(3)]
        except AggregationError as error:
            return error

    with ThreadPoolExecutor(3) as pool:  # in whatever order the Joins and pushes reach the aggregator
        outcomes = list(pool.map(train, clients, [1.0, 100.0, 5.0]))
    refused = outcomes[1]
    assert isinstance(refused, AggregationError), refused
    assert refused.refusal == "MODEL_MISMATCH"
    assert "without it" in refused.details
    for means in (outcomes[0], outcomes[2]):
        assert isinstance(means, list), means
        assert all(np.allclose(mean, 3.0) for mean in means)  # every step averages the two right hosts
