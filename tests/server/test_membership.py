"""What a round waits for, by membership: an elastic job's members past its world size, named when they are missing."""

from __future__ import annotations

import numpy as np
import pytest
from round_calls import push, wait

from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server.errors import RoundAbortedError
from gradq.server.membership import ANY_RANK
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable
from gradq.server.state_relay import StateHeader, StateRelays

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
VALUES = encode(np.ones(4, np.float32), EXACT)


def replaced_member_table(partial_quorum: int) -> tuple[RoundTable, list[float]]:
    """An elastic job of world_size 2 whose member 0 was replaced by member 2: it trains as members 1 and 2."""
    clock = [0.0]
    table = RoundTable(RoundPolicy(round_timeout_s=1.0, partial_quorum=partial_quorum), clock=lambda: clock[0])
    for member in (0, 1):
        table.join("grow", member, 2, "run", elastic=True)
    assert table.join("grow", ANY_RANK, 2, "run", elastic=True).rank == 2  # pending: it waits for the state
    relays = StateRelays(table, lambda job, event: None)
    relays.open("grow", 2, "run")
    relays.claim("grow", 0, "run", 2, StateHeader(sender=0, step=0, total_bytes=1))  # admitted from step 0
    table.leave("grow", 0, "run")
    assert table.active_jobs() == {"grow": [1, 2]}
    return table, clock


def test_a_round_failed_at_its_deadline_names_the_live_members_that_did_not_push() -> None:
    table, clock = replaced_member_table(partial_quorum=0)
    ticket = push(table, "grow", 0, 0, 1, VALUES, incarnation="run")
    clock[0] = 1.0  # the deadline: member 2 never pushed
    with pytest.raises(RoundAbortedError, match=r"with ranks \[2\] missing") as failed:
        wait(table, ticket)
    assert "[0]" not in str(failed.value)  # member 0 left: the round did not wait for it


def test_a_partial_round_at_its_deadline_names_the_live_members_that_did_not_push() -> None:
    table, clock = replaced_member_table(partial_quorum=1)
    ticket = push(table, "grow", 0, 0, 1, VALUES, incarnation="run")
    clock[0] = 1.0
    result = wait(table, ticket)
    assert result.partial and result.missing == (2,) and result.contributors == (1,)
