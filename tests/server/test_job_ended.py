"""A host that comes back to a run whose other hosts finished and left is told at once that the job ended."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import StartAggregator
from waiting import wait_until

from gradq.client import WorkerClient, serde
from gradq.client.elastic import ANY_RANK
from gradq.client.membership import JobEndedError
from gradq.qcore import QuantConfig, Scheme
from gradq.server.ended_runs import EndedRuns
from gradq.server.errors import FailedPreconditionError, Refusal
from gradq.server.job_spec import JobSpec, MemberRole
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def spec(rank: int, role: MemberRole = MemberRole.STARTING, incarnation: str = "run", job_id: str = "end") -> JobSpec:
    return JobSpec(job_id, rank, 2, incarnation, elastic=True, role=role)


def ended_table(clock: list[float], job_id: str = "end", incarnation: str = "run") -> RoundTable:
    """A table whose elastic job ``job_id`` ran with members 0 and 1, which both left with a Leave."""
    table = RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: clock[0], limits=ServiceLimits())
    for rank in (0, 1):
        table.join(spec(rank, incarnation=incarnation, job_id=job_id))
    for rank in (0, 1):
        table.leave(job_id, rank, incarnation)
    assert table.active_jobs() == {}
    return table


@pytest.mark.parametrize("role", [MemberRole.RESUMING, MemberRole.JOINING])
def test_a_host_back_to_a_run_whose_members_all_left_is_told_the_job_ended(role: MemberRole) -> None:
    table = ended_table([0.0])
    with pytest.raises(FailedPreconditionError, match=r"job 'end' \(incarnation='run'\) has ended") as refused:
        table.join(spec(1, role))
    assert refused.value.refusal is Refusal.JOB_ENDED
    assert table.active_jobs() == {}  # the refused Join started no run that would wait for a formation


def test_a_new_run_of_the_ended_job_starts_under_any_incarnation() -> None:
    table = ended_table([0.0])
    table.join(spec(0, incarnation="run-2"))  # a new incarnation
    table.leave("end", 0, "run-2")
    table.join(spec(0))  # a starting host under the ended incarnation starts the job afresh
    assert table.join(spec(1, MemberRole.RESUMING)).rank == 1  # and that run is live: resuming it is no refusal
    assert table.active_jobs() == {"end": [0, 1]}


def test_a_run_whose_hosts_were_all_lost_has_not_ended() -> None:
    table = RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: 0.0)
    for rank in (0, 1):
        table.join(spec(rank))
    with table.jobs.lock:
        job = table.jobs.current("end")
        assert job is not None
        for rank in (0, 1):  # their Watch streams ended without a Leave: crashed, not finished
            assert job.members.lose(rank, "its Watch stream ended")
    with pytest.raises(FailedPreconditionError) as refused:
        table.join(spec(1, MemberRole.RESUMING))
    assert refused.value.refusal is Refusal.NOT_JOINED  # dropped: it joins as a newcomer; the job did not end


def test_ended_runs_are_forgotten_after_the_idle_timeout() -> None:
    clock = [0.0]
    table = ended_table(clock)
    clock[0] = ServiceLimits().job_idle_timeout_s + 1.0
    table.join(spec(1, MemberRole.RESUMING))  # forgotten: the host resumes a run of its own, as before


def test_ended_runs_remembered_are_bounded_however_many_jobs_end() -> None:
    runs = EndedRuns(keep_s=600.0, kept=3)
    long_run = "x" * 100_000  # an incarnation has no length limit: what is remembered must not grow with it
    for number in range(5):
        runs.remember(f"job-{number}", long_run, now=float(number))
    assert [runs.ended(f"job-{n}", long_run, 5.0) for n in range(5)] == [False, False, True, True, True]
    assert len(runs) == 3
    assert all(len(job_id) + len(digest) < 64 for job_id, digest in runs.remembered())
    assert not runs.ended("job-4", long_run + "y", 5.0)  # another run of the job never ended
    runs.forget("job-4", long_run)  # a new run under that incarnation started
    assert not runs.ended("job-4", long_run, 5.0)
    assert not runs.ended("job-3", long_run, 3.0 + 600.5)  # and each is kept for keep_s only
    assert len(runs) == 0  # (job-2 and job-3 expired too, oldest first)


def test_the_table_forgets_the_oldest_ended_run_first() -> None:
    table = RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: 0.0)
    table.jobs.ended_runs = EndedRuns(keep_s=600.0, kept=1)
    for job_id in ("job-0", "job-1"):
        table.join(spec(0, job_id=job_id))
        table.leave(job_id, 0, "run")
    table.join(spec(0, MemberRole.RESUMING, job_id="job-0"))  # forgotten: it resumes a run of its own, as before
    with pytest.raises(FailedPreconditionError) as refused:
        table.join(spec(0, MemberRole.RESUMING, job_id="job-1"))
    assert refused.value.refusal is Refusal.JOB_ENDED


@pytest.fixture
def hosts() -> Iterator[Callable[..., WorkerClient]]:
    clients: list[WorkerClient] = []

    def make(address: str) -> WorkerClient:
        client = WorkerClient(
            [address],
            "end",
            ANY_RANK,
            serde.JobSpec(world_size=2, elastic=True),
            EXACT,
            timeout_s=20,
            incarnation="run",
            retry_backoff_s=0.1,
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_a_host_cut_off_while_the_others_finish_learns_the_job_ended_at_its_next_push(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient]
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=60.0))
    table = server.table
    first, second = hosts(f"127.0.0.1:{server.port}"), hosts(f"127.0.0.1:{server.port}")
    for client in (first, second):
        client.join()
    means = [
        client.push_pull_async(0, 0, np.full(4, value, np.float32)) for client, value in ((first, 1.0), (second, 3.0))
    ]
    assert all(np.allclose(mean.result(timeout=30), 2.0) for mean in means)
    watch = second.membership._watches[0]
    assert watch is not None
    watch.cancel()  # the second host is cut off: the aggregator drops it, and the first goes on alone
    wait_until(
        lambda: table.active_jobs() == {"end": [first.membership.rank]}, "the aggregator to drop the cut-off host", 10.0
    )
    first.close()  # the first host finishes and leaves: the run has ended
    wait_until(lambda: table.active_jobs() == {}, "the run to end", 10.0)
    with pytest.raises(JobEndedError, match=r"job 'end' .* has finished") as ended:
        second.push_pull(1, 0, np.ones(4, np.float32))  # it rejoins as RESUMING: refused at once, no formation
    assert ended.value.refusal == "JOB_ENDED"
    assert table.active_jobs() == {}
