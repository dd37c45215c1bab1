"""The session's member answers a drop: ``member.rejoin`` joins again on the same terms and counts it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from gradq.client.config import GradqConfig
from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession, JobSpec
from gradq.client.session.training_log import TrainingSummary
from gradq.server.app import AggregatorServer


class _Loop:
    """Stands for the adapter whose end ends the run (the summary holds a weak reference to it)."""


def test_a_dropped_member_rejoins_on_the_same_terms_and_counts_it(aggregator: AggregatorServer) -> None:
    config = GradqConfig.of(f"127.0.0.1:{aggregator.port}", job_id="member-rejoin", elastic_hosts=2)
    calls: list[BaseException] = []

    def on_drop(error: BaseException) -> bool:
        calls.append(error)
        return True

    with ThreadPoolExecutor(2) as pool:  # the job's two hosts join together
        job = JobSpec(model_signature="m")
        first, other = pool.map(lambda _: GradqSession.connect(config, job=job, on_drop=on_drop), (0, 1))
    sessions = [first, other]
    try:
        assert first.failures.absorb is on_drop  # the drop callback is given at connect, not patched on after
        dropped = AggregationError("127.0.0.1", None, "not a member", refusal="NOT_JOINED")
        rejoined = first.member.rejoin(dropped)
        sessions.append(rejoined)
        assert first.closed and not rejoined.closed and rejoined.mode == "gradq"
        assert (first.member.rejoins, rejoined.member.rejoins) == (0, 1)
        assert rejoined.failures.absorb is on_drop  # the same terms: the callback too
        assert rejoined.client is not None and rejoined.client.spec.model_signature == "m"  # and the job's spec
        assert rejoined.client.spec.elastic and rejoined.client.spec.world_size == 2  # placed from the config
        owner = _Loop()
        summary = TrainingSummary(owner, "custom loop")
        summary.attach(first.events)
        summary.attach(rejoined.events)
        assert summary.rejoins == 1  # the summary reads the member's count
        again = rejoined.member.rejoin(dropped)
        sessions.append(again)
        assert again.member.rejoins == 2 and rejoined.closed
        assert calls == []  # nothing failed in a backward pass
    finally:
        for session in sessions:
            session.close()
