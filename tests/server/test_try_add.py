"""RoundTable.try_add, the event loop's add: it takes only what can neither wait nor finish a round."""

from __future__ import annotations

import numpy as np
from round_calls import push, wait

from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.job_spec import JobSpec
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundResult, RoundTable

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def _table(world_size: int) -> RoundTable:
    table = RoundTable(RoundPolicy(round_timeout_s=5.0, return_scheme=Scheme.FLOAT32))
    for rank in range(world_size):
        table.join(JobSpec("job", rank, world_size))
    return table


def _bucket(rank: int) -> np.ndarray:
    return np.arange(6, dtype=np.float32) * (rank + 1)


def test_it_adds_all_but_the_last_contribution_and_the_mean_is_the_same() -> None:
    table = _table(3)
    tickets = []
    for rank in (0, 1):
        tensor = encode(_bucket(rank), EXACT)
        ticket = table.admit("job", 0, 0, rank, tensor)
        assert table.try_add(ticket, tensor)
        tickets.append(ticket)
    assert not tickets[0].round.done.is_set()
    last = encode(_bucket(2), EXACT)
    ticket = table.admit("job", 0, 0, 2, last)
    assert not table.try_add(ticket, last)  # it would finish the round: left to add (a pool thread)
    assert ticket.round.contributors == {0, 1}
    table.add(ticket, last)
    for each in (*tickets, ticket):
        result = wait(table, each)
        assert isinstance(result, RoundResult)
        np.testing.assert_array_equal(decode(result.mean), np.arange(6, dtype=np.float32) * 2.0)
        assert result.contributors == (0, 1, 2)


def test_it_leaves_resends_held_locks_and_done_rounds_to_add() -> None:
    table = _table(3)
    tensor = encode(_bucket(0), EXACT)
    ticket = push(table, "job", 0, 0, 0, tensor)
    assert not table.try_add(table.admit("job", 0, 0, 0, tensor), tensor)  # a resend: add checks its digest
    other = encode(_bucket(1), EXACT)
    ticket = table.admit("job", 0, 0, 1, other)
    with ticket.round.lock:  # a pool thread holds it (decoding, re-encoding): the loop must not wait
        assert not table.try_add(ticket, other)
    assert ticket.round.contributors == {0}
    assert table.try_add(ticket, other)
    push(table, "job", 0, 0, 2, encode(_bucket(2), EXACT))
    assert ticket.round.done.is_set()
    assert not table.try_add(table.admit("job", 0, 0, 1, other), other)  # done: add answers it
