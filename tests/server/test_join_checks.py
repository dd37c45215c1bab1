"""A Join's own checks (JobSpec.check) and which run an elastic Join belongs to (gradq.server.elastic_runs).

Driven directly, without a server: each refusal names the field, its value and what was expected, and
the run rules are decided from what the table holds, with ``now`` passed in.
"""

from __future__ import annotations

import pytest

from gradq.qcore.outer_step import OuterStep
from gradq.server.budget import MemoryAccount
from gradq.server.elastic_runs import check_not_ended, is_newcomer, run_to_join
from gradq.server.ended_runs import EndedRuns
from gradq.server.errors import FailedPreconditionError, InvalidArgumentError, Refusal
from gradq.server.job import Job
from gradq.server.job_spec import ANY_RANK, JobSpec, MemberRole
from gradq.server.membership import Membership
from gradq.server.semi_sync import SemiSync

LIMIT = 16  # --max-world-size


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (JobSpec("j", 0, world_size=0), ["world_size=0", "expected 1..16"]),
        (JobSpec("j", 0, world_size=17), ["world_size=17", "expected 1..16"]),
        (JobSpec("j", 0, world_size=4, job_ranks=3), ["job_ranks=3", "expected 4..16"]),
        (JobSpec("j", 0, world_size=4, job_ranks=17), ["job_ranks=17", "expected 4..16"]),
        (JobSpec("j", 4, world_size=4), ["rank=4", "expected 0..3"]),
        (JobSpec("j", ANY_RANK, world_size=4), [f"rank={ANY_RANK}", "elastic"]),
        (JobSpec("j", 16, world_size=4, elastic=True), ["rank=16", "expected 0..15"]),
        (JobSpec("j", 0, world_size=2, ranks=17), ["ranks=17", "expected 1..16"]),
        (JobSpec("", 0, world_size=2), ["job_id=''", "characters"]),
        (JobSpec("j", 0, world_size=2, outer_step=OuterStep(lr=0.7)), ["outer_step", "elastic"]),
        (JobSpec("j", 0, world_size=2, elastic=True, semi_sync=SemiSync(1, 1.0)), ["semi_sync", "needs outer_step"]),
        (JobSpec("j", 0, world_size=2, role=MemberRole.RESUMING), ["role=RESUMING", "expected STARTING"]),
        (JobSpec("j", 0, world_size=2, elastic=True, training_members=2), ["training_members=2", "RESUMING"]),
    ],
)
def test_a_malformed_join_is_refused_naming_the_field_the_value_and_what_was_expected(
    spec: JobSpec, named: list[str]
) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        spec.check(LIMIT)
    for words in named:
        assert words in str(refused.value)


def test_a_well_formed_join_passes_at_the_bounds() -> None:
    JobSpec("j", 15, world_size=16).check(LIMIT)
    JobSpec("j", 0, world_size=4, job_ranks=16, ranks=4).check(LIMIT)
    JobSpec("j", 15, world_size=2, elastic=True).check(LIMIT)  # elastic ids outgrow the starting world
    JobSpec("j", ANY_RANK, world_size=2, elastic=True).check(LIMIT)


def _run(incarnation: str, world_size: int = 2) -> Job:
    members = Membership(world_size, world_size, elastic=True)
    return Job("j", incarnation, 0.0, MemoryAccount("job 'j'", 1 << 20), members)


def _spec(role: MemberRole, incarnation: str, rank: int = ANY_RANK) -> JobSpec:
    return JobSpec("j", rank, world_size=2, incarnation=incarnation, elastic=True, role=role)


def test_a_host_that_resumes_or_waits_for_a_run_that_ended_is_told_so_and_a_new_run_may_start() -> None:
    ended = EndedRuns(keep_s=600.0)
    ended.remember("j", "run-1", now=100.0)
    for role in (MemberRole.RESUMING, MemberRole.JOINING):
        with pytest.raises(FailedPreconditionError) as refused:
            check_not_ended(ended, _spec(role, "run-1", rank=1), None, now=200.0)
        assert refused.value.refusal is Refusal.JOB_ENDED
        assert "has ended" in str(refused.value) and "'run-1'" in str(refused.value)
    check_not_ended(ended, _spec(MemberRole.STARTING, "run-1"), None, now=200.0)  # starts it afresh
    check_not_ended(ended, _spec(MemberRole.RESUMING, "run-2", rank=1), None, now=200.0)  # another run
    check_not_ended(ended, _spec(MemberRole.RESUMING, "run-1", rank=1), _run("run-1"), now=200.0)  # live again
    check_not_ended(ended, _spec(MemberRole.RESUMING, "run-1", rank=1), None, now=701.0)  # forgotten by then


def test_a_run_that_never_trained_yields_to_a_host_resuming_its_own_and_one_that_trained_does_not() -> None:
    fresh = _run("shard-restart")
    assert run_to_join(fresh, _spec(MemberRole.STARTING, "other")) == "shard-restart"
    assert run_to_join(fresh, _spec(MemberRole.RESUMING, "held", rank=0)) == "held"
    trained = _run("shard-restart")
    trained.newest_completed_step = 3
    with pytest.raises(FailedPreconditionError) as refused:
        run_to_join(trained, _spec(MemberRole.RESUMING, "held", rank=0))
    assert refused.value.refusal is Refusal.ANOTHER_RUN and "which has trained" in str(refused.value)


def test_a_host_without_state_joins_a_trained_run_only_as_a_newcomer_with_no_id_of_its_own() -> None:
    run = _run("live")
    assert not is_newcomer(run, _spec(MemberRole.STARTING, "mine"))  # nothing trained: it may start with it
    run.newest_completed_step = 0
    run.members.formed = True
    assert is_newcomer(run, _spec(MemberRole.STARTING, "mine"))
    assert not is_newcomer(run, _spec(MemberRole.STARTING, "live"))  # a host of the run itself
    with pytest.raises(FailedPreconditionError) as refused:
        is_newcomer(run, _spec(MemberRole.STARTING, "mine", rank=1))
    assert refused.value.refusal is Refusal.ANOTHER_RUN and "member 1" in str(refused.value)
    run.members.formed = False  # re-forming on a restarted shard: no id is known to be free yet
    with pytest.raises(FailedPreconditionError) as refused:
        is_newcomer(run, _spec(MemberRole.STARTING, "mine"))
    assert "re-forming" in str(refused.value)
