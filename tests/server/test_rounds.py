"""The round logic driven directly (no gRPC): means, duplicates, deadlines, quorum, staleness."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from round_calls import contribute, push, wait

from gradq.qcore import QuantConfig, Scheme, decode, encode
from gradq.server.errors import CancelledError, FailedPreconditionError, InvalidArgumentError, RoundAbortedError
from gradq.server.job_spec import JobSpec
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundResult, RoundTable

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def contribute_all(
    table: RoundTable,
    ranks: list[int],
    make: Callable[[int], np.ndarray],
    step: int = 0,
    bucket: int = 0,
    config: QuantConfig = EXACT,
) -> dict[int, RoundResult | Exception]:
    """Each rank pushes, then each waits for its answer; returns rank -> result or exception."""
    tickets = {rank: push(table, "job", step, bucket, rank, encode(make(rank), config)) for rank in ranks}
    results: dict[int, RoundResult | Exception] = {}
    for rank, ticket in tickets.items():
        try:
            results[rank] = wait(table, ticket)
        except Exception as error:  # collected and asserted on by the caller
            results[rank] = error
    return results


def joined_table(world_size: int, **policy: object) -> RoundTable:
    table = RoundTable(RoundPolicy(**policy))  # type: ignore[arg-type]
    for rank in range(world_size):
        table.join(JobSpec("job", rank, world_size))
    return table


def test_mean_of_integer_gradients_is_exact() -> None:
    table = joined_table(4, round_timeout_s=5.0, return_scheme=Scheme.FLOAT32)
    results = contribute_all(table, [0, 1, 2, 3], lambda r: np.arange(10, dtype=np.float32) * (r + 1))
    expected = np.arange(10, dtype=np.float32) * 2.5
    for result in results.values():
        assert isinstance(result, RoundResult)
        np.testing.assert_array_equal(decode(result.mean), expected)
        assert result.contributors == (0, 1, 2, 3) and not result.partial


def test_duplicate_contribution_is_counted_once_and_answered_the_same() -> None:
    table = joined_table(2, round_timeout_s=5.0, return_scheme=Scheme.FLOAT32)
    ones = encode(np.ones(8, np.float32), EXACT)
    resent = [push(table, "job", 0, 0, 0, ones) for _ in range(3)]  # rank 0 sends the same bucket three times
    answers = [contribute(table, "job", 0, 0, 1, encode(np.full(8, 3.0, np.float32), EXACT))]
    answers += [wait(table, ticket) for ticket in resent]
    retry = contribute(table, "job", 0, 0, 0, ones)  # after completion: same answer, not a new round
    assert len(answers) == 4
    for answer in [*answers, retry]:
        np.testing.assert_array_equal(decode(answer.mean), np.full(8, 2.0, np.float32))
    assert retry is answers[0]
    assert table.counters["contributions"] == 2 and table.counters["rounds_completed"] == 1


def test_missing_rank_fails_round_at_deadline_naming_it() -> None:
    clock = [0.0]
    table = RoundTable(RoundPolicy(round_timeout_s=0.5), clock=lambda: clock[0])
    for rank in range(3):
        table.join(JobSpec("job", rank, 3))
    tickets = [push(table, "job", 0, 0, rank, encode(np.ones(4, np.float32), EXACT)) for rank in (0, 2)]
    clock[0] = 0.49
    with pytest.raises(CancelledError):
        wait(table, tickets[0], patience=0.001)  # before the deadline the round waits for rank 1
    clock[0] = 0.5
    for ticket in tickets:
        with pytest.raises(RoundAbortedError, match=r"ranks \[1\] missing"):
            wait(table, ticket)
    assert table.in_flight() == 0


def test_partial_policy_completes_over_quorum_and_says_so() -> None:
    table = joined_table(3, round_timeout_s=0.3, partial_quorum=2, return_scheme=Scheme.FLOAT32)
    results = contribute_all(table, [0, 1], lambda r: np.full(4, float(r + 1), np.float32))
    for result in results.values():
        assert isinstance(result, RoundResult)
        assert result.partial and result.missing == (2,) and result.contributors == (0, 1)
        np.testing.assert_array_equal(decode(result.mean), np.full(4, 1.5, np.float32))
    with pytest.raises(FailedPreconditionError, match="without rank 2"):
        contribute(table, "job", 0, 0, 2, encode(np.ones(4, np.float32), EXACT))


def test_numel_mismatch_is_rejected_and_round_stays_intact() -> None:
    table = joined_table(2, round_timeout_s=5.0, return_scheme=Scheme.FLOAT32)
    first = push(table, "job", 0, 0, 0, encode(np.ones(6, np.float32), EXACT))  # opens the round: 6 elements
    with pytest.raises(InvalidArgumentError, match=r"tensor.numel=5 does not match numel=6"):
        contribute(table, "job", 0, 0, 1, encode(np.ones(5, np.float32), EXACT))
    result = contribute(table, "job", 0, 0, 1, encode(np.full(6, 3.0, np.float32), EXACT))
    assert wait(table, first) is result
    np.testing.assert_array_equal(decode(result.mean), np.full(6, 2.0, np.float32))


def test_unknown_job_and_rank_are_failed_preconditions() -> None:
    table = joined_table(2, round_timeout_s=1.0)
    tensor = encode(np.ones(3, np.float32), EXACT)
    with pytest.raises(FailedPreconditionError, match="job 'other' has no joined ranks"):
        contribute(table, "other", 0, 0, 0, tensor)
    table.leave("job", 1)
    with pytest.raises(FailedPreconditionError, match=r"rank=1 has not joined job 'job'"):
        contribute(table, "job", 0, 0, 1, tensor)


def test_stale_step_is_rejected_after_newer_rounds_finish() -> None:
    table = joined_table(1, round_timeout_s=1.0, retain_steps=2)
    tensor = encode(np.ones(3, np.float32), EXACT)
    for step in range(6):
        contribute(table, "job", step, 0, 0, tensor)
    assert contribute(table, "job", 3, 0, 0, tensor).contributors == (0,)  # retained: answered again
    with pytest.raises(FailedPreconditionError, match=r"step=2 is stale.*expected step in \[3, 9\]"):
        contribute(table, "job", 2, 0, 0, tensor)


def test_join_rejects_bad_world_and_rank() -> None:
    table = RoundTable(RoundPolicy(world_size=4))
    with pytest.raises(FailedPreconditionError, match=r"configuration mismatch: this job has 3 ranks.*--world-size=4"):
        table.join(JobSpec("job", 0, 3))
    with pytest.raises(InvalidArgumentError, match=r"rank=4 is out of range; expected 0..3"):
        table.join(JobSpec("job", 4, 4))
    with pytest.raises(InvalidArgumentError, match="job_id"):
        table.join(JobSpec("", 0, 4))
    table.join(JobSpec("job", 0, 4))
    answer = table.join(JobSpec("job", 0, 4))  # rejoin is idempotent
    assert (answer.world_size, answer.joined) == (4, 1)


def test_leave_closes_rounds_waiting_for_that_rank_at_once() -> None:
    clock = [0.0]
    table = RoundTable(RoundPolicy(round_timeout_s=30.0), clock=lambda: clock[0])
    for rank in range(2):
        table.join(JobSpec("job", rank, 2))
    ticket = push(table, "job", 0, 0, 0, encode(np.ones(3, np.float32), EXACT))
    table.leave("job", 1)
    assert ticket.round.done.is_set()  # closed by the Leave: the clock never reached the deadline
    with pytest.raises(RoundAbortedError, match="rank 1 left the job"):
        wait(table, ticket)


def test_mean_returned_on_pushers_grid_by_default() -> None:
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=4, channel_size=64)
    table = joined_table(2, round_timeout_s=5.0)
    rng = np.random.default_rng(1)
    inputs = {r: rng.normal(size=1000).astype(np.float32) for r in range(2)}
    results = contribute_all(table, [0, 1], inputs.__getitem__, config=config)
    mean = results[0]
    assert isinstance(mean, RoundResult)
    assert (mean.mean.scheme, mean.mean.bits, mean.mean.channel_size) == (Scheme.PER_CHANNEL_AFFINE, 4, 64)


def test_server_error_feedback_carries_the_return_error_forward() -> None:
    x = np.linspace(-1.0, 1.0, 101, dtype=np.float32) ** 3
    totals = {}
    for feedback in (False, True):
        table = joined_table(
            1,
            round_timeout_s=5.0,
            server_error_feedback=feedback,
            return_scheme=Scheme.PER_TENSOR_AFFINE,
            return_bits=2,
        )
        sent = np.zeros_like(x)
        for step in range(40):
            sent += decode(contribute(table, "job", step, 0, 0, encode(x, EXACT)).mean)
        totals[feedback] = float(np.abs(sent / 40 - x).max())
    step_size = 2.0 / 3  # 2 bits over [-1, 1]
    assert totals[True] < 0.1 * step_size < totals[False]


def test_a_round_divides_by_the_ranks_its_members_stand_for_also_when_partial() -> None:
    table = RoundTable(RoundPolicy(round_timeout_s=0.5, partial_quorum=1, return_scheme=Scheme.FLOAT32))
    for host, ranks in enumerate((3, 1, 2)):
        table.join(JobSpec("job", host, 3, ranks=ranks))
    sums = {0: 3 * 2.0, 1: 6.0, 2: 2 * 5.0}  # each host pushes the sum over its ranks
    results = contribute_all(table, [0, 1, 2], lambda host: np.full(8, sums[host], np.float32))
    for result in results.values():
        assert isinstance(result, RoundResult)
        np.testing.assert_array_equal(decode(result.mean), np.full(8, 22.0 / 6, np.float32))
        assert result.ranks == 6 and result.contributors == (0, 1, 2)
    # Host 2 (2 ranks) misses the deadline: the partial mean is over the 4 ranks present, and says so.
    results = contribute_all(table, [0, 1], lambda host: np.full(8, sums[host], np.float32), step=1)
    for result in results.values():
        assert isinstance(result, RoundResult)
        np.testing.assert_array_equal(decode(result.mean), np.full(8, 12.0 / 4, np.float32))
        assert result.ranks == 4 and result.missing == (2,)
