"""Faults with real processes: a worker killed or stopped mid-training, an aggregator killed and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fault_workers import Event, collect, exact_mean, gather, gradient, start_workers
from waiting import port_refuses, wait_until

from gradq.client import WorkerClient
from gradq.qcore import QuantConfig, Scheme
from gradq.server.process import free_port, spawn_aggregator

ROUND_TIMEOUT_S = 2.0


def start_aggregator(port: int, *extra: str) -> subprocess.Popen[bytes]:
    flags = ("--round-timeout", str(ROUND_TIMEOUT_S), "--log-level", "WARNING", *extra)
    return spawn_aggregator(*flags, port=port)[0]


@pytest.fixture
def aggregators() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_killed_worker_is_named_to_survivors_within_deadline_and_server_keeps_serving(
    tmp_path: Path, aggregators: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    aggregators.append(start_aggregator(port))
    address = f"127.0.0.1:{port}"
    workers, events = start_workers(address, "three", world=3, steps=6, hang={2: 3})
    try:
        before = collect(events, 3 * 3 + 1, timeout_s=60)  # steps 0-2 for everyone, then rank 2 hangs
        assert all(ok for _, _, ok, _, _ in before), before
        assert workers[2].pid is not None
        os.kill(workers[2].pid, signal.SIGKILL)
        survivors = collect(events, 2, timeout_s=ROUND_TIMEOUT_S + 10)
    finally:
        for worker in workers:
            worker.kill()
    for rank, step, ok, detail, seconds in survivors:
        assert rank in (0, 1) and step == 3 and not ok
        assert "ABORTED" in detail and "ranks [2] missing" in detail, detail
        assert seconds <= ROUND_TIMEOUT_S + 10.0, seconds  # failed at its deadline, not hanging
    config = QuantConfig(scheme=Scheme.FLOAT32)
    results: dict[int, np.ndarray] = {}

    def fresh(rank: int) -> None:
        with WorkerClient(address, "after-the-crash", rank, 2, config, timeout_s=10) as client:
            results[rank] = client.push_pull(0, 0, gradient(rank, 0))

    threads = [threading.Thread(target=fresh, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for rank in (0, 1):
        np.testing.assert_array_equal(results[rank], exact_mean(2, 0))


def test_ranks_realign_after_one_is_stopped_longer_than_the_deadline(
    aggregators: list[subprocess.Popen[bytes]],
) -> None:
    """SIGSTOP past two round deadlines: its late pushes fail at once, then every step completes.

    The operator chose to wait for a stopped rank (--keepalive-timeout past the stop), so it is not lost.
    """
    port = free_port()
    aggregators.append(start_aggregator(port, "--keepalive-timeout", "30"))
    stop_at, steps, missed = 2, 12, 2  # rank 2 stays stopped until the others have failed ``missed`` steps each
    workers, events = start_workers(
        f"127.0.0.1:{port}", "stopped", world=3, steps=steps, stop={2: stop_at}, keep_going=True
    )
    outcomes: dict[tuple[int, int], Event] = {}
    try:
        for event in collect(events, 3 * stop_at + 1, timeout_s=60):  # steps 0-1 for all, then rank 2 stops
            outcomes[event[:2]] = event
        assert outcomes[(2, stop_at)][3] == "stopping"
        assert workers[2].pid is not None
        os.kill(workers[2].pid, signal.SIGSTOP)

        def failed_while_stopped(rank: int) -> int:
            return sum(not outcomes[key][2] for key in outcomes if key[0] == rank and key[1] >= stop_at)

        # Ranks 0 and 1 fail a step per deadline meanwhile: rank 2 comes back once each has failed some.
        gather(
            events,
            outcomes,
            lambda: min(failed_while_stopped(0), failed_while_stopped(1)) >= missed,
            f"ranks 0 and 1 to fail {missed} steps each while rank 2 is stopped",
            timeout_s=60,
        )
        stopped_for = max(failed_while_stopped(0), failed_while_stopped(1))
        os.kill(workers[2].pid, signal.SIGCONT)
        gather(
            events,
            outcomes,
            lambda: len([key for key in outcomes if key[1] >= stop_at]) >= 3 * (steps - stop_at),
            "every rank's outcome of every step after the stop",
            timeout_s=60,
        )
    finally:
        for worker in workers:
            worker.kill()
    late = [outcomes[(2, step)] for step in range(stop_at, steps) if not outcomes[(2, step)][2]]
    print("rank 2 after SIGCONT:", [(step, ok, f"{seconds:.2f} s") for _, step, ok, _, seconds in late])
    assert late, "rank 2 was stopped past several deadlines: its first steps after SIGCONT must fail"
    for _, step, _, detail, seconds in late:
        assert "ABORTED" in detail and "ranks [2] missing" in detail, detail
        # At once: a failed round's answer is kept, not waited for again (generous on 2 busy cores).
        assert seconds < ROUND_TIMEOUT_S, f"step {step}: a failed round's answer waited {seconds:.2f} s"
    # Realigned: from the first step rank 2 completes, every step completes for every rank.
    first = min(step for step in range(stop_at, steps) if outcomes[(2, step)][2])
    assert first <= stop_at + 2 + stopped_for, (first, stopped_for)
    for step in range(first, steps):
        for rank in range(3):
            assert outcomes[(rank, step)][2], outcomes[(rank, step)]


def test_a_rank_stopped_past_the_keepalive_is_lost_at_once_and_counted_back_when_it_resumes(
    aggregators: list[subprocess.Popen[bytes]],
) -> None:
    """SIGSTOP past the keepalive (the default): the others' rounds fail at once naming it; then it rejoins."""
    port = free_port()
    aggregators.append(start_aggregator(port))
    stop_at, steps = 2, 12
    workers, events = start_workers(
        f"127.0.0.1:{port}", "keepalive", world=3, steps=steps, stop={2: stop_at}, keep_going=True
    )
    outcomes: dict[tuple[int, int], Event] = {}
    try:
        for event in collect(events, 3 * stop_at + 1, timeout_s=60):
            outcomes[event[:2]] = event
        assert workers[2].pid is not None
        os.kill(workers[2].pid, signal.SIGSTOP)
        gather(
            events,
            outcomes,
            lambda: len([key for key in outcomes if key[0] < 2 and key[1] >= stop_at]) >= 2 * (steps - stop_at),
            "ranks 0 and 1 through every step while rank 2 is stopped",
            timeout_s=60,
        )
        os.kill(workers[2].pid, signal.SIGCONT)
        gather(
            events,
            outcomes,
            lambda: len([key for key in outcomes if key[0] == 2 and key[1] >= stop_at]) >= steps - stop_at,
            "rank 2 through every step after it resumes",
            timeout_s=60,
        )
    finally:
        for worker in workers:
            worker.kill()
    # The others knew rank 2 was lost within the keepalive and stopped waiting for it: every later round failed at
    # once, naming it, instead of at each round deadline.
    others = [outcomes[(rank, step)] for rank in (0, 1) for step in range(stop_at + 1, steps)]
    assert all(not ok and "rank 2 was lost" in detail for _, _, ok, detail, _ in others), others
    # At once: well inside the round deadline each would otherwise have waited (generous on 2 busy cores).
    assert all(seconds < ROUND_TIMEOUT_S for *_, seconds in others), others
    # Rank 2, alive again, was counted back in: after the round it was lost in, no answer says it is lost. That
    # round is the one it stopped in, or the next when the keepalive (1-2.5 s) outlasts the 2 s round deadline.
    lost_in = min(step for step in range(stop_at, steps) if "rank 2 was lost" in outcomes[(0, step)][3])
    assert lost_in <= stop_at + 1, lost_in
    mine = [outcomes[(2, step)] for step in range(lost_in + 1, steps)]
    assert all("rank 2 was lost" not in detail for _, _, _, detail, _ in mine), mine


def test_aggregator_killed_and_restarted_mid_training_never_double_counts(
    tmp_path: Path, aggregators: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    aggregators.append(start_aggregator(port))
    steps = 12
    workers, events = start_workers(f"127.0.0.1:{port}", "restart", world=2, steps=steps, pause_s=0.2)
    try:
        collect(events, 2 * 3, timeout_s=60)  # let three steps complete
        aggregators[0].kill()  # a crash: no graceful shutdown
        aggregators[0].wait()
        wait_until(lambda: port_refuses(port), f"port {port} closed with the killed aggregator", timeout_s=10)
        aggregators.append(start_aggregator(port))
        outcomes: dict[tuple[int, int], Event] = {}
        gather(events, outcomes, lambda: not any(w.is_alive() for w in workers), "both workers to end", 90)
        gather(events, outcomes, lambda: True, "the last outcomes", 1)  # what they put just before they ended
        rest = list(outcomes.values())
    finally:
        for worker in workers:
            worker.kill()
    # Documented policy: clients retry the same (step, bucket, rank) after rejoining. Every
    # round that completes is exact (nothing counted twice); a round that cannot be re-formed
    # (an answer was delivered to one rank before the crash) fails naming the missing rank.
    failures = [detail for _, _, ok, detail, _ in rest if not ok]
    print(f"after the restart: {len(rest)} outcomes, failures: {failures}")
    completed = [(rank, step) for rank, step, ok, _, _ in rest if ok]
    for detail in failures:
        assert "ABORTED" in detail and "missing" in detail, detail
    if not failures:
        assert sorted(completed) == sorted((rank, step) for rank in (0, 1) for step in range(3, steps))
    assert completed, rest
