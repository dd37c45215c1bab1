"""ShardWindow on its own, and WorkerClient holding pushes back with it against a real aggregator."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import pytest
from waiting import wait_until

from gradq.client import AggregationError, WorkerClient
from gradq.client.ddp import GradqHookState
from gradq.client.window import ShardWindow
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy

EXACT = QuantConfig(scheme=Scheme.FLOAT32)


def test_window_admits_up_to_its_limit_per_shard_then_hands_slots_on_in_order() -> None:
    window: ShardWindow[str] = ShardWindow(shards=2, limit=2)
    assert [window.admit(0, name) for name in ("a", "b", "c", "d")] == [True, True, False, False]
    assert window.admit(1, "x")  # another shard has its own slots
    assert window.release(0, "a") == ["c"]  # c takes over the settled push's slot
    assert window.release(0, "b") == ["d"]
    assert window.release(0, "c") == [] and window.release(0, "d") == []  # both slots free again
    assert window.admit(0, "e") and window.admit(0, "f") and not window.admit(0, "g")
    assert window.admit(1, "y") and not window.admit(1, "z")
    assert window.drain(0) == ["g"] and window.drain(0) == []  # one shard's queue
    assert window.close() == ["z"]  # every shard's queue; from now on everything is sent at once
    assert window.admit(0, "late") and window.admit(1, "later")


def test_window_without_a_limit_admits_everything() -> None:
    window: ShardWindow[int] = ShardWindow(shards=1, limit=None)
    assert all(window.admit(0, index) for index in range(100))
    assert window.release(0, 0) == []


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_invalid_limits_are_refused_naming_the_field(limit: object) -> None:
    with pytest.raises(ValueError, match=r"max_in_flight=.* expected an integer >= 1, or None"):
        ShardWindow(1, limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_in_flight="):
        GradqHookState("127.0.0.1:1", max_in_flight=limit)  # type: ignore[arg-type]


def contributors(server: AggregatorServer, job_id: str) -> dict[tuple[int, int], set[int]]:
    """(step, bucket) -> the ranks whose push its open round holds, as the aggregator's table has them now."""
    with server.table.jobs.lock:
        job = next((job for job in server.table.jobs.all() if job.job_id == job_id), None)
        if job is None:
            return {}
        rounds = list(job.rounds.items())
    found = {}
    for key, rnd in rounds:
        with rnd.lock:
            found[key] = set(rnd.contributors)
    return found


@pytest.fixture
def server(start_aggregator: Callable[..., AggregatorServer]) -> AggregatorServer:
    return start_aggregator(RoundPolicy(world_size=2, round_timeout_s=10.0))


def test_a_held_back_push_goes_out_once_the_one_before_it_settles(server: AggregatorServer) -> None:
    address = f"127.0.0.1:{server.port}"
    ones, twos = np.ones(64, np.float32), np.full(64, 2.0, np.float32)
    with (
        WorkerClient(address, "window", 0, 2, EXACT, max_in_flight=1) as held,
        WorkerClient(address, "window", 1, 2, EXACT) as free,
    ):
        first = held.push_pull_async(0, 0, ones)
        second = held.push_pull_async(0, 1, ones)  # waits: bucket 0 is still in flight
        other_second = free.push_pull_async(0, 1, twos)
        arrived = {(0, 0): {0}, (0, 1): {1}}  # (step, bucket) -> ranks: all but rank 0's held-back bucket 1
        wait_until(
            lambda: contributors(server, "window") == arrived, "every push but the held-back one on the aggregator"
        )
        # Rank 0's bucket 1 has not reached the aggregator, so its round cannot finish.
        assert not other_second.done() and not second.done()
        other_first = free.push_pull_async(0, 0, twos)  # round 0 completes; rank 0's bucket 1 goes out
        for future in (first, second, other_first, other_second):
            np.testing.assert_array_equal(future.result(timeout=10), np.full(64, 1.5, np.float32))
    assert server.table.counters["rounds_completed"] == 2


def test_closing_fails_the_pushes_still_waiting_instead_of_hanging(server: AggregatorServer) -> None:
    client = WorkerClient(f"127.0.0.1:{server.port}", "closing", 0, 2, EXACT, max_in_flight=1, timeout_s=30.0)
    client.join()
    in_flight = client.push_pull_async(0, 0, np.ones(8, np.float32))  # rank 1 never comes
    waiting = client.push_pull_async(0, 1, np.ones(8, np.float32))
    client.close()
    with pytest.raises(AggregationError, match="client closed before the push was sent"):
        waiting.result(timeout=5)
    with pytest.raises(AggregationError):
        in_flight.result(timeout=5)  # the closed channel cancels it


def test_closing_while_a_push_backs_off_settles_it_and_the_ones_behind_it(
    server: AggregatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gradq.client.sending")
    client = WorkerClient(
        f"127.0.0.1:{server.port}", "backoff", 0, 2, EXACT, max_in_flight=1, retry_backoff_s=1.0, timeout_s=5.0
    )
    client.join()
    server.stop()  # pushes now fail with UNAVAILABLE and back off for a second
    first = client.push_pull_async(0, 0, np.ones(8, np.float32))
    second = client.push_pull_async(0, 1, np.ones(8, np.float32))
    wait_until(
        lambda: any("unavailable; retry 1/" in record.getMessage() for record in caplog.records),
        "the first push backing off",
    )
    client.close()
    with pytest.raises(AggregationError, match="closed while the push waited to retry"):
        first.result(timeout=5)
    with pytest.raises(AggregationError, match="closed before the push was sent"):
        second.result(timeout=5)


def test_an_unreachable_shard_fails_every_waiting_push_at_once(server: AggregatorServer) -> None:
    client = WorkerClient(
        f"127.0.0.1:{server.port}", "outage", 0, 2, EXACT, max_in_flight=1, max_retries=1, retry_backoff_s=0.05
    )
    client.membership.timeout_s = 1.0  # the rejoin's patience: one timeout for the whole queue, not one per push
    client.join()
    server.stop()
    started = time.monotonic()
    futures = [client.push_pull_async(0, bucket, np.ones(8, np.float32)) for bucket in range(6)]
    errors = [future.exception(timeout=10) for future in futures]
    assert all(isinstance(error, AggregationError) for error in errors)
    assert all("not sent: an earlier push to this shard failed" in str(error) for error in errors[1:])
    assert time.monotonic() - started < 4.0  # one rejoin timeout (1 s) for the queue, not one per push (6 s)
    client.close()


def test_pushes_after_close_fail_at_once(server: AggregatorServer) -> None:
    client = WorkerClient(f"127.0.0.1:{server.port}", "late", 0, 2, EXACT, max_in_flight=1)
    client.join()
    client.close()
    futures = [client.push_pull_async(0, bucket, np.ones(8, np.float32)) for bucket in range(400)]
    assert all("the client is closed" in str(future.exception(timeout=5)) for future in futures)
