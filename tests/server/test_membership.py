"""What a round waits for, by membership: an elastic job's members past its world size, named when they are missing."""

from __future__ import annotations

import numpy as np
import pytest
from round_calls import push, wait

from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server.errors import RoundAbortedError
from gradq.server.job_spec import JobSpec
from gradq.server.limits import ServiceLimits
from gradq.server.liveness import Liveness
from gradq.server.membership import ANY_RANK, Membership
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
        table.join(JobSpec("grow", member, 2, "run", elastic=True))
    assert table.join(JobSpec("grow", ANY_RANK, 2, "run", elastic=True)).rank == 2  # pending: it waits for the state
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


def watching_table() -> tuple[RoundTable, Liveness]:
    table = RoundTable(RoundPolicy(round_timeout_s=30.0))
    return table, Liveness(table, ServiceLimits(), late_after_s=1.5)


def members_of(table: RoundTable, job_id: str) -> Membership:
    return next(job.members for job in table.jobs.all() if job.job_id == job_id)


@pytest.mark.parametrize("elastic", [True, False])
def test_a_former_holders_watch_ending_never_hits_the_member_that_took_its_id(elastic: bool) -> None:
    table, liveness = watching_table()
    for member in (0, 1):
        table.join(JobSpec("reuse", ANY_RANK if elastic else member, 2, "run", elastic=elastic))
    former = liveness.open("reuse", 1, "run")
    # The order of events the issue saw: member 1 leaves, a new holder joins as 1, then the old stream ends.
    table.leave("reuse", 1, "run")
    assert table.join(JobSpec("reuse", ANY_RANK if elastic else 1, 2, "run", elastic=elastic)).rank == 1
    liveness.close(former)
    members = members_of(table, "reuse")
    assert members.holds(1, pending_ok=True) and 1 not in members.lost and 1 not in members.dropped

    # The new holder's own stream ending is its loss, as before.
    current = liveness.open("reuse", 1, "run")
    liveness.close(current)
    assert not members.holds(1, pending_ok=True) if elastic else 1 in members.lost


def test_every_rank_of_a_host_watches_the_same_tenure_of_its_member() -> None:
    table, liveness = watching_table()
    for _ in range(2):  # a host's two ranks join as member 0, one after the other: a rejoin keeps the tenure
        table.join(JobSpec("host", 0, 1, "run"))
    watches = [liveness.open("host", 0, "run") for _ in range(2)]
    assert watches[0].tenure == watches[1].tenure != 0
    liveness.close(watches[0])  # either rank's process exiting is the member's loss
    assert 0 in members_of(table, "host").lost


def test_a_round_failed_before_an_elastic_job_formed_says_how_many_hosts_joined() -> None:
    clock = [0.0]
    table = RoundTable(RoundPolicy(round_timeout_s=1.0), clock=lambda: clock[0])
    table.join(JobSpec("forming", ANY_RANK, 3, "run", elastic=True))  # 1 of the 3 hosts it starts with
    ticket = push(table, "forming", 0, 0, 0, VALUES, incarnation="run")
    clock[0] = 1.0
    with pytest.raises(RoundAbortedError, match=r"before the elastic job formed: 1 of the 3 hosts it starts with"):
        wait(table, ticket)
