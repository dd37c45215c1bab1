"""DiLoCo seeds held to the job on a real aggregator: one size per key, finite values, one outer round, real cost.

Each refusal comes at once (the rounds' deadline is 20 s) and names what
differs; the hosts are WorkerClients on real channels.
"""

from __future__ import annotations

import gc
import logging
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import StartAggregator
from outer_hosts import STEP, Host, joiner_of
from waiting import wait_until

from gradq.client import AggregationError, WorkerClient
from gradq.qcore.outer_step import take_outer_step
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.outer_service import AGGREGATOR_SENDER
from gradq.server.outer_state import KEY_ENTRY_BYTES, OuterState
from gradq.server.policy import RoundPolicy
from gradq.server.state_relay import RELAY_BYTES
from gradq.server.step_window import GRID_ENTRY_BYTES

DEADLINE_S = 20.0
AT_ONCE_S = 5.0  # a refusal "at once": well inside the rounds' deadline
KEYS = 2


def values(seed: int, size: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=size).astype(np.float32)


def refused(call: Callable[[], object]) -> tuple[AggregationError, float]:
    """The refusal ``call`` raises, and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(AggregationError) as error:
        call()
    return error.value, time.monotonic() - started


@pytest.fixture
def server(start_aggregator: StartAggregator) -> AggregatorServer:
    return start_aggregator(RoundPolicy(round_timeout_s=DEADLINE_S))


@pytest.fixture
def host(server: AggregatorServer) -> Iterator[Host]:
    clients: list[WorkerClient] = []
    yield joiner_of(server.port, clients, DEADLINE_S)
    for client in clients:
        client.close()


# -- one size per key --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [0, 1])
def test_a_seed_fixes_its_keys_size_and_a_push_of_another_is_refused_at_once(host: Host, key: int) -> None:
    only = host(hosts=1)
    start = values(0, 10)
    assert only.membership.seed_outer(0, key, KEYS, start, None)[0]
    error, took = refused(lambda: only.push_pull(0, key, values(1)))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and took < AT_ONCE_S
    assert f"a push of key {key} holds 1000 elements; expected 10, the size of key {key} in job 'd'" in error.details
    # A later seed of another length.
    error, _ = refused(lambda: only.membership.seed_outer(0, key, KEYS, values(2), None))
    assert f"a seed of key {key} holds 1000 elements; expected 10" in error.details
    # A push of the key's size moves the copy: the aggregator's is what the host computes.
    mean = only.push_pull(0, key, values(3, 10))
    parameters, momentum = start.copy(), np.zeros_like(start)
    take_outer_step(parameters, momentum, mean, STEP)
    assert only.membership.seed_outer(1, key, KEYS, parameters, momentum)[:2] == (True, 1)


@pytest.mark.parametrize("key", [0, 1])
def test_a_push_fixes_its_keys_size_and_a_seed_of_another_is_refused(host: Host, key: int) -> None:
    only = host(hosts=1)
    only.push_pull(0, key, values(1))  # before any seed (after a restart, hosts push before they seed)
    error, took = refused(lambda: only.membership.seed_outer(1, key, KEYS, values(0, 10), None))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and took < AT_ONCE_S
    assert f"a seed of key {key} holds 10 elements; expected 1000, the size of key {key} in job 'd'" in error.details
    assert only.membership.seed_outer(1, key, KEYS, values(0), None)[0]
    error, _ = refused(lambda: only.push_pull(1, key, values(1, 10)))
    assert f"a push of key {key} holds 10 elements; expected 1000" in error.details
    assert only.membership.seed_outer(1, 1 - key, KEYS, values(0), None)[0]
    error, _ = refused(lambda: only.push_pull(1, KEYS, values(1)))  # the seeds fixed the keys: 0 and 1
    assert f"a push of round key {KEYS} is one too many for job 'd'" in error.details


def test_a_round_that_moves_no_global_state_says_why(caplog: pytest.LogCaptureFixture) -> None:
    state = OuterState(STEP)
    with caplog.at_level(logging.INFO, logger="gradq.server.outer_state"):
        assert not state.advance(0, 0, values(1), "job 'j'")
        assert "round (step=0, key=0) moves no global state on the aggregator: the key is not seeded" in caplog.text
        state.seed(0, 1, 3, values(0), None, "job 'j'")
        assert not state.advance(0, 2, values(1), "job 'j'")
        assert "its copy of the key stands before outer round 3 and holds 1000 elements" in caplog.text


# -- finite values only ------------------------------------------------------------------------------


@pytest.mark.parametrize("non_finite", ["reject", "skip"])
@pytest.mark.parametrize("field", ["parameters", "momentum"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_seed_is_refused_naming_the_key_and_index_and_holds_nothing(
    start_aggregator: StartAggregator, non_finite: str, field: str, bad: float
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=DEADLINE_S, non_finite=non_finite))
    clients: list[WorkerClient] = []
    first, second = (joiner_of(server.port, clients, DEADLINE_S)() for _ in range(2))
    try:

        def poisoned(step: int) -> tuple[np.ndarray, np.ndarray]:
            parameters, momentum = values(5), values(6)
            (parameters if field == "parameters" else momentum)[[3, 700]] = bad
            return parameters, momentum

        held = server.table.budget.in_use
        error, _ = refused(lambda: first.membership.seed_outer(0, 1, KEYS, *poisoned(0)))  # the job's first seed
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{field} of key 1 holds {bad} at index 3 (2 values not finite)" in error.details
        assert server.table.budget.in_use == held  # nothing held, nothing charged
        good = values(0), values(1)
        assert first.membership.seed_outer(0, 1, KEYS, *good)[0]
        error, _ = refused(lambda: second.membership.seed_outer(4, 1, KEYS, *poisoned(4)))  # would replace the copy
        assert f"{field} of key 1 holds {bad} at index 3" in error.details
        matched, step, _, _ = second.membership.seed_outer(0, 1, KEYS, *good)  # the copy is the good one still
        assert (matched, step) == (True, 0)
    finally:
        for client in clients:
            client.close()


# -- one outer round: the newest ---------------------------------------------------------------------


def seed_all(client: WorkerClient, step: int, state: list[tuple[np.ndarray, np.ndarray]]) -> list[bool]:
    return [client.membership.seed_outer(step, key, KEYS, *state[key])[0] for key in range(KEYS)]


def push_all(client: WorkerClient, step: int, pseudo: list[np.ndarray]) -> list[Future[np.ndarray]]:
    return [client.push_pull_async(step, key, pseudo[key]) for key in range(KEYS)]


def behind_at_once(futures: list[Future[np.ndarray]]) -> None:
    """Every push of the host behind is refused (BEHIND) at once, naming the job's outer round and its own."""
    for future in futures:
        error = future.exception(timeout=AT_ONCE_S)
        assert isinstance(error, AggregationError), error
        assert error.refusal == "BEHIND" and error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "outer round 7" in error.details and "outer round 5" in error.details


ORDERS = ["older seed first", "newer seed first", "older pushes before the newer seed", "pushes only"]


@pytest.mark.parametrize("order", ORDERS)
def test_hosts_at_different_outer_rounds_follow_the_newest_and_the_one_behind_catches_up(
    start_aggregator: StartAggregator, order: str
) -> None:
    # A restarted aggregator holds nothing. Its first run had both hosts seed outer round 5; host B then went
    # on alone (say from a later checkpoint) to round 7, and both come back to the restarted one.
    first_run = start_aggregator(RoundPolicy(round_timeout_s=DEADLINE_S))
    clients: list[WorkerClient] = []
    a_state = [(values(10 + key), values(20 + key)) for key in range(KEYS)]
    for client in (joiner_of(first_run.port, clients, DEADLINE_S)(), joiner_of(first_run.port, clients, DEADLINE_S)()):
        assert all(seed_all(client, 5, a_state))
    for client in clients:
        client.close()
    port = first_run.port
    first_run.stop()
    restarted = AggregatorServer(
        RoundPolicy(round_timeout_s=DEADLINE_S), ServerOptions(f"127.0.0.1:{port}", grace_s=1.0)
    )
    restarted.start()
    clients = []
    join = joiner_of(port, clients, DEADLINE_S)
    b_state = [(values(30 + key), values(40 + key)) for key in range(KEYS)]
    pool = ThreadPoolExecutor(1)
    try:
        a, b = join(), join()
        a_pushes = [values(50 + key) for key in range(KEYS)]
        b_pushes = [values(60 + key) for key in range(KEYS)]
        if order == "older seed first":
            assert all(seed_all(a, 5, a_state)) and all(seed_all(b, 7, b_state))
            behind_at_once(push_all(a, 5, a_pushes))
        elif order == "newer seed first":
            assert all(seed_all(b, 7, b_state))
            answers = [a.membership.seed_outer(5, key, KEYS, *a_state[key]) for key in range(KEYS)]
            assert [(matched, step, theirs) for matched, step, theirs, _ in answers] == [(False, 7, b"")] * KEYS
            behind_at_once(push_all(a, 5, a_pushes))
        elif order == "older pushes before the newer seed":
            assert all(seed_all(a, 5, a_state))
            waiting = push_all(a, 5, a_pushes)
            wait_until(lambda: restarted.table.in_flight() == KEYS, "host A's rounds to open")
            assert all(seed_all(b, 7, b_state))
            behind_at_once(waiting)
        else:  # after a restart the hosts push first and seed after their first round
            waiting = push_all(a, 5, a_pushes)
            wait_until(lambda: restarted.table.in_flight() == KEYS, "host A's rounds to open")
            b_round = push_all(b, 7, b_pushes)
            behind_at_once(waiting)
            assert [f.result(timeout=AT_ONCE_S) is not None for f in b_round] == [True] * KEYS
        # Host A is pending now, as a late host: it waits for the job's state from the aggregator's copy.
        waiting_from = restarted.table.budget.in_use
        fetched = pool.submit(a.membership.fetch_state)
        wait_until(lambda: restarted.table.budget.in_use >= waiting_from + RELAY_BYTES, "host A to wait for the state")
        expected = []
        if order == "pushes only":  # host B seeds after its round, as a restarted host does: that is the state
            b_state = [(values(70 + key), values(80 + key)) for key in range(KEYS)]
            assert all(seed_all(b, 8, b_state))
            expected = b_state
        else:  # host B's round 7 closes over B alone (A no longer holds it up), and that is the state
            means = [f.result(timeout=AT_ONCE_S) for f in push_all(b, 7, b_pushes)]
            for (parameters, momentum), mean in zip(b_state, means, strict=True):
                parameters, momentum = parameters.copy(), momentum.copy()
                take_outer_step(parameters, momentum, mean, STEP)
                expected.append((parameters, momentum))
            np.testing.assert_array_equal(means[0], b_pushes[0])  # B's own: A's push is not in it
        (received,) = fetched.result(timeout=AT_ONCE_S)
        assert (received.step, received.sender) == (8, AGGREGATOR_SENDER)
        state = np.frombuffer(received.data, dtype="<f4").reshape(2, KEYS, -1)
        for key in range(KEYS):
            np.testing.assert_array_equal(state[0, key], expected[key][0])
            np.testing.assert_array_equal(state[1, key], expected[key][1])
        # From round 8 on both hosts train together again, and the copy they step alike is the aggregator's.
        rounds = [push_all(client, 8, a_pushes) for client in (a, b)]
        a_means, b_means = ([f.result(timeout=AT_ONCE_S) for f in futures] for futures in rounds)
        for key, (parameters, momentum) in enumerate(expected):
            np.testing.assert_array_equal(a_means[key], b_means[key])
            np.testing.assert_allclose(a_means[key], a_pushes[key], rtol=1e-6)
            take_outer_step(parameters, momentum, a_means[key], STEP)
        assert seed_all(a, 9, expected) == seed_all(b, 9, expected) == [True] * KEYS
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for client in clients:
            client.close()
        restarted.stop()


# -- each key charged at its real cost -----------------------------------------------------------------


def test_each_outer_key_is_charged_its_entry_and_arrays_and_holds_no_more_on_the_heap(
    host: Host, server: AggregatorServer
) -> None:
    keys, only = 1000, host(hosts=1)
    one = np.ones(1, np.float32)
    assert only.membership.seed_outer(0, 0, keys, one, None)[0]  # the job's state exists: what follows is per key
    charged = server.table.budget.in_use
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in range(1, keys):
            only.membership.seed_outer(0, key, keys, one, None)
        gc.collect()
        heap = (tracemalloc.get_traced_memory()[0] - before) / (keys - 1)
    finally:
        tracemalloc.stop()
    per_key = (server.table.budget.in_use - charged) / (keys - 1)
    print(f"per one-element key: Python heap {heap:.0f} B, charged {per_key:.0f} B")
    assert per_key == KEY_ENTRY_BYTES + 2 * one.nbytes  # its entry, its parameters and its momentum
    # What the heap holds per key stays under the charge (bench/outer_key_memory.py: the process's RSS too).
    assert heap <= per_key
    only.push_pull(0, keys - 1, one)  # a push of a seeded key adds its bucket's grid and its mean, no entry
    assert GRID_ENTRY_BYTES < server.table.budget.in_use - charged - (keys - 1) * per_key < KEY_ENTRY_BYTES
    only.close()
    wait_until(lambda: server.table.budget.in_use == 0, "the ended job's state to be given back")
