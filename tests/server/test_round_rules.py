"""The round rules alone (sync and semi-sync), driven with a clock of the test's, and as the round table calls them."""

from __future__ import annotations

import numpy as np
import pytest
from round_calls import push, wait

from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server.buffers import AccumulatorPool
from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.job_spec import JobSpec
from gradq.server.policy import PushedGrid, RoundPolicy
from gradq.server.round_rules import SYNC_RULES, SemiSyncRules, rules_for
from gradq.server.round_state import Round, RoundResult
from gradq.server.rounds import RoundTable
from gradq.server.semi_sync import SemiSync

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def a_round(deadline: float = 30.0) -> Round:
    grid = PushedGrid(Scheme.FLOAT32, 32, 0, 4, "float32")
    return Round(0, 0, grid, deadline, AccumulatorPool().take(4))


def closed_over(rnd: Round, contributors: tuple[int, ...]) -> Round:
    rnd.result = RoundResult(None, contributors)
    rnd.done.set()
    return rnd


def test_sync_rules_wait_for_every_member_and_never_take_a_late_push() -> None:
    rnd = a_round()
    rnd.contributors.update({0, 1, 2})
    SYNC_RULES.counted(rnd, now=10.0)
    assert (rnd.deadline, rnd.graced) == (30.0, False)  # no quorum brings a synchronous round forward
    assert SYNC_RULES.quorum(partial_quorum=3) == (3, True)  # --partial-quorum, in ranks
    assert SYNC_RULES.close_reason(rnd, 30.0) == ("deadline of 30 s passed", "deadline")
    closed_over(rnd, (0, 1))
    assert not SYNC_RULES.takes_late(rnd, 2)  # answered from the round (its mean or its failure)
    SYNC_RULES.answer("j", rnd, 2)  # no refusal of its own
    assert SYNC_RULES.counts_inline()


def test_semi_sync_rules_grace_a_round_once_a_quorum_has_pushed() -> None:
    rules = SemiSyncRules(SemiSync(quorum=2, grace_s=1.5))
    rnd = a_round(deadline=30.0)
    rnd.contributors.add(0)
    rules.counted(rnd, now=4.0)
    assert (rnd.deadline, rnd.graced) == (30.0, False)  # one host is no quorum of two
    rnd.contributors.add(1)
    rules.counted(rnd, now=5.0)
    assert (rnd.deadline, rnd.graced) == (6.5, True)  # the grace runs from the quorum's push
    rnd.contributors.add(2)
    rules.counted(rnd, now=6.0)
    assert rnd.deadline == 6.5  # a later push never moves the grace window
    assert rules.close_reason(rnd, 30.0) == ("grace window of 1.5 s after a quorum of 2 passed", "grace")
    assert rules.quorum(partial_quorum=5) == (2, False)  # its own quorum, in hosts
    assert not rules.counts_inline()


def test_semi_sync_rules_close_an_ungraced_round_at_its_deadline() -> None:
    rules = SemiSyncRules(SemiSync(quorum=3, grace_s=1.0))
    rnd = a_round()
    rnd.contributors.add(0)
    rules.counted(rnd, now=1.0)
    assert rules.close_reason(rnd, 30.0) == ("deadline of 30 s passed", "deadline")


def test_semi_sync_rules_take_a_push_to_a_round_closed_without_its_member_as_late_and_refuse_it_the_mean() -> None:
    rules = SemiSyncRules(SemiSync(quorum=2, grace_s=1.0))
    rnd = a_round()
    assert not rules.takes_late(rnd, 2)  # the round is open: the push counts
    closed_over(rnd, (0, 1))
    assert not rules.takes_late(rnd, 0)  # a contributor's resend is answered the mean
    rules.answer("j", rnd, 0)
    assert rules.takes_late(rnd, 2)
    with pytest.raises(FailedPreconditionError, match="member 2 was late") as late:
        rules.answer("j", rnd, 2)
    assert late.value.refusal is Refusal.LATE


def test_a_job_has_the_rules_its_joins_asked_for() -> None:
    assert rules_for(None) is SYNC_RULES
    assert isinstance(rules_for(SemiSync(quorum=2, grace_s=1.0)), SemiSyncRules)
    table = RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: 0.0)
    table.join(JobSpec("sync", 0, 2, "run"))
    with table.jobs.lock:
        job = table.jobs.current("sync")
        assert job is not None and job.rules is SYNC_RULES


def test_the_table_closes_a_semi_sync_round_when_the_rules_grace_passes_on_its_clock() -> None:
    clock = [0.0]
    table = RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: clock[0])
    for rank in range(3):
        table.join(JobSpec("semi", rank, 3, "run"))
    with table.jobs.lock:  # the table asks the job's rules, whatever made them (a DiLoCo Join's semi_sync)
        job = table.jobs.current("semi")
        assert job is not None
        job.rules = SemiSyncRules(SemiSync(quorum=2, grace_s=2.0))
    values = encode(np.ones(4, np.float32), EXACT)
    tickets = [push(table, "semi", 0, 0, rank, values, incarnation="run") for rank in (0, 1)]
    clock[0] = 1.9
    table.sweep()
    assert not tickets[0].round.done.is_set()  # inside the grace window
    clock[0] = 2.0
    table.sweep()  # the grace passed on the table's clock: closed over the quorum, without member 2
    result = wait(table, tickets[0])
    assert (result.contributors, result.missing) == ((0, 1), (2,))
