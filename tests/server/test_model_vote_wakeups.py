"""A Join waiting for the start quorum's model vote is woken by what changes the vote, not by polling a clock."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from conftest import StartAggregator
from waiting import wait_until

from gradq.client import WorkerClient, serde
from gradq.client.elastic import ANY_RANK
from gradq.qcore import QuantConfig, Scheme
from gradq.server.job_spec import JobSpec
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable
from gradq.server.table_events import Unserved

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
RIGHT = "0.fc.weight float32[64, 32]"
ODD = "0.fc.weight float32[32, 32]"


def test_the_table_says_when_a_jobs_vote_may_have_changed() -> None:
    table = RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: 0.0)
    told: list[str] = []

    class Told(Unserved):
        def model_vote_changed(self, job_id: str) -> None:
            told.append(job_id)

    table.listen(Told())
    odd = table.join(JobSpec("vote", ANY_RANK, 2, "run", elastic=True, model_signature=ODD))
    right = table.join(JobSpec("vote", ANY_RANK, 2, "run", elastic=True, model_signature=RIGHT))
    assert right.model_undecided and told == ["vote", "vote"]  # each Join of an elastic job
    table.vote.give_up("vote", right.rank, "run")
    assert told[-1] == "vote" and len(told) == 3  # a waiting Join given up
    table.leave("vote", odd.rank, "run")
    assert len(told) >= 4  # a Leave (and the run it retired)


def test_a_waiting_join_is_answered_as_soon_as_the_host_it_disagreed_with_leaves(
    start_aggregator: StartAggregator,
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=30.0))
    address = f"127.0.0.1:{server.port}"

    def host(model: str, incarnation: str) -> WorkerClient:
        return WorkerClient(
            [address], "vote", ANY_RANK, serde.JobSpec(world_size=2, elastic=True, model_signature=model), EXACT,
            timeout_s=20, incarnation=incarnation,
        )  # fmt: skip

    odd, right = host(ODD, "run-odd"), host(RIGHT, "run-right")
    try:
        odd.join()
        with ThreadPoolExecutor(1) as pool:
            waiting: Future[None] = pool.submit(right.join)  # disagrees with the odd host: it waits for a vote
            wait_until(lambda: server.table.active_jobs().get("vote") == [0, 1], "the right host's Join to wait", 10)
            assert not waiting.done()
            odd.close()  # nobody disagrees any more: the waiting Join is answered now, not at its deadline
            waiting.result(timeout=15)  # (it would be refused after ~20 s had nothing woken it)
        assert server.table.active_jobs() == {"vote": [right.membership.rank]}
    finally:
        odd.close()
        right.close()
