"""A host built with another model that starts first: the start quorum's model is the job's, on every shard.

Real hosts (examples/elastic_train.py) and real `gradq serve` processes. The
odd host (a narrower MLP) joins before the right ones; the job must not take
its model: it is refused by name once two of the three hosts the job starts
with agree, and the three right hosts train the run to its end together.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic_hosts import finish, start_host, stop, wait_for

from gradq.server.process import free_port, spawn_aggregator

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

HOSTS = 3
STEPS = 60
STEP_SLEEP_S = 0.02


@pytest.fixture(params=[1, 2], ids=["one-shard", "two-shards"])
def shards(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The shards' address, and the first shard's log (its Joins are logged at INFO)."""
    ports = [free_port() for _ in range(request.param)]
    log = tmp_path / "shard0.log"
    with log.open("wb") as first_log:
        processes: list[subprocess.Popen[bytes]] = [
            # The odd host's first round waits for three right hosts to start torch on a loaded machine: a round
            # deadline past that start, so the odd host meets the vote and not the deadline.
            spawn_aggregator(
                "--log-level",
                "INFO",
                "--round-timeout",
                "120",
                port=port,
                stderr=first_log if index == 0 else subprocess.DEVNULL,
            )[0]
            for index, port in enumerate(ports)
        ]
    yield ",".join(f"127.0.0.1:{port}" for port in ports), log
    for process in processes:
        process.kill()
        process.wait()


def test_the_odd_host_that_starts_first_is_refused_and_the_right_ones_train(
    shards: tuple[str, Path], tmp_path: Path
) -> None:
    address, log = shards
    odd = start_host(address, "first-odd", HOSTS, STEPS, tmp_path / "odd.jsonl", STEP_SLEEP_S, hidden=32)
    right = []
    try:
        # The odd host joins alone first (the first shard logs it), before any right host starts.
        wait_for("the odd host's Join", lambda: "to job 'first-odd'" in log.read_text(errors="replace"), 120, [odd])
        right = [
            start_host(address, "first-odd", HOSTS, STEPS, tmp_path / f"r{i}.jsonl", STEP_SLEEP_S) for i in range(3)
        ]
        output, _ = odd.process.communicate(timeout=120)
        text = output.decode(errors="replace")
        assert odd.process.returncode != 0, text[-2000:]
        assert re.search(
            r"this host's model differs from .* at tensor 0: this host has '0\S*weight float32\[32, ", text
        ), text[-3000:]
        wait_for("the right hosts at step 5", lambda: min(h.last_step() for h in right) >= 5, 120, right)
        finish(right, timeout_s=240)
    finally:
        for host in (odd, *right):
            stop(host)
    assert len({host.result()["parameters_sha256"] for host in right}) == 1
    assert all(max(host.steps()) == STEPS - 1 for host in right)
