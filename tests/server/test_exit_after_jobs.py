"""`gradq serve --exit-after-jobs N` as a real process: it exits 0 once every rank of N jobs has left."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from gradq.client import WorkerClient
from gradq.qcore import QuantConfig, Scheme
from gradq.server.healthcheck import is_serving
from gradq.server.process import spawn_aggregator

CONFIG = QuantConfig(scheme=Scheme.FLOAT32)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def train_and_leave(address: str, job_id: str, world_size: int) -> None:
    """Every rank of ``job_id`` joins, averages one bucket and leaves (WorkerClient.close sends Leave)."""
    clients = [WorkerClient(address, job_id, rank, world_size, CONFIG) for rank in range(world_size)]
    for client in clients:
        client.join()
    pending = [client.push_pull_async(0, 0, np.full(8, rank, np.float32)) for rank, client in enumerate(clients)]
    for done in pending:
        np.testing.assert_allclose(done.result(timeout=30), np.full(8, (world_size - 1) / 2))
    for client in clients:
        client.close()


def still_serving(process: subprocess.Popen[str], address: str) -> bool:
    """Whether the aggregator neither exits within half a second (a stop would have ended it by then) nor stops
    answering."""
    try:
        process.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return is_serving(address)
    return False


def test_exits_0_once_every_rank_of_n_jobs_has_left(processes: list[subprocess.Popen[str]]) -> None:
    process, port = spawn_aggregator(
        stderr=subprocess.PIPE, text=True, env={**os.environ, "GRADQ_EXIT_AFTER_JOBS": "2"}
    )
    processes.append(process)
    address = f"127.0.0.1:{port}"
    first = [WorkerClient(address, "first", rank, 2, CONFIG) for rank in range(2)]
    for client in first:
        client.join()
    first[0].close()
    assert still_serving(process, address), "one rank of two left: the job is not finished"
    first[1].close()
    assert still_serving(process, address), "one job of two finished"
    train_and_leave(address, "second", 3)
    assert process.wait(timeout=30) == 0
    log = process.stderr.read() if process.stderr else ""
    assert "job 'second' finished: every rank left (2 job(s) finished)" in log, log
    assert "--exit-after-jobs=2 reached" in log and "stopped" in log, log


def test_off_by_default_serves_on_after_jobs_finish(processes: list[subprocess.Popen[str]]) -> None:
    process, port = spawn_aggregator(stderr=subprocess.DEVNULL, text=True)
    processes.append(process)
    address = f"127.0.0.1:{port}"
    train_and_leave(address, "only", 2)
    assert still_serving(process, address)


def test_negative_count_exits_2_naming_the_flag() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "gradq.server", "--port", "0", "--exit-after-jobs", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert "--exit-after-jobs=-1 is invalid; expected 0 (serve until stopped) or >= 1" in completed.stderr
