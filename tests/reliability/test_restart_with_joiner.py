"""A shard restarts while a standby host joins, with natural timing: real hosts, real `gradq serve` processes.

Two elastic hosts train (examples/elastic_train.py); one aggregator shard is
SIGKILLed between steps and started again on its port, and a warm standby
is told to join at that moment, so it may reach the empty shard before the
survivors do. The shard must serve the run the hosts hold, not one the
standby starts: every host ends the run (exit 0) with the same parameters.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic_hosts import finish, start_host, stop, wait_for

from gradq.server.process import free_port, spawn_aggregator

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

HOSTS = 2
STEPS = 150
STEP_SLEEP_S = 0.02


class Aggregators:
    """One `gradq serve` process per shard, each restartable on its port."""

    def __init__(self, count: int) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.processes: list[subprocess.Popen[bytes]] = [self._spawn(port) for port in self.ports]

    @property
    def address(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def kill(self, shard: int) -> None:
        self.processes[shard].kill()
        self.processes[shard].wait()

    def start(self, shard: int) -> None:
        self.processes[shard] = self._spawn(self.ports[shard])

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()

    @staticmethod
    def _spawn(port: int) -> subprocess.Popen[bytes]:
        return spawn_aggregator("--log-level", "WARNING", port=port)[0]


@pytest.fixture(params=[(1, 0), (2, 0), (2, 1)], ids=["one-aggregator", "shard-0", "shard-1"])
def restart(request: pytest.FixtureRequest) -> Iterator[tuple[Aggregators, int]]:
    shards, restarted = request.param
    group = Aggregators(shards)
    yield group, restarted
    group.close()


def test_a_standby_joining_while_a_shard_restarts_never_takes_the_job(
    restart: tuple[Aggregators, int], tmp_path: Path
) -> None:
    group, restarted = restart
    address = group.address
    go = tmp_path / "join"
    hosts = [start_host(address, "ef", HOSTS, STEPS, tmp_path / f"host{i}.jsonl", STEP_SLEEP_S) for i in range(2)]
    standby = start_host(address, "ef", HOSTS, STEPS, tmp_path / "standby.jsonl", STEP_SLEEP_S, go)
    try:
        wait_for("every host at step 20", lambda: min(h.last_step() for h in hosts) >= 20, 120, hosts)
        group.kill(restarted)
        go.touch()  # the standby dials now: the shard is down or empty when it gets there
        time.sleep(0.5)  # the natural timing under test: the shard stays down a moment, whatever dials it
        group.start(restarted)
        finish([*hosts, standby], timeout_s=240)
    finally:
        for host in (*hosts, standby):
            stop(host)
    results = [host.result() for host in (*hosts, standby)]
    assert len({result["parameters_sha256"] for result in results}) == 1, results
    steps = hosts[0].steps()
    assert max(steps) == STEPS - 1
    # The standby joined the job in training, as a newcomer: it trained no step of a run of its own (one the
    # restarted shard may have started with it is dropped at its first push, and it joins again then).
    assert min(standby.steps()) > 20, sorted(standby.steps())[:5]
