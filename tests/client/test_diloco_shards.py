"""DiLoCo with the outer step on two aggregator shards: each holds the global state of its own round keys.

Hosts are real processes (examples/diloco_train.py) and the shards real
aggregators on real ports. The model travels as several round keys
(``--bucket-elements``), spread over both shards: every shard is seeded, moves
its keys' state, sends joiners its part, and is seeded again by the hosts when
it restarts alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_diloco import (
    EXAMPLE,
    REPO,
    RUN_TIMEOUT_S,
    SPARSE,
    SYNC_EVERY,
    StartAggregator,
    assert_identical,
    finish,
    wait_for_round,
)

from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

# The character transformer's ~100k parameters as 5 or 6 round keys: both shards hold some.
BUCKET_ELEMENTS = 20_000


SHARD_POLICY = RoundPolicy(round_timeout_s=60.0, server_error_feedback=False)


@pytest.fixture
def shards(start_aggregator: StartAggregator) -> list[AggregatorServer]:
    return [start_aggregator(SHARD_POLICY), start_aggregator(SHARD_POLICY)]


def start(
    shards: list[AggregatorServer],
    job_id: str,
    seed: int,
    out: Path,
    *args: str,
    variables: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": ",".join(f"127.0.0.1:{server.port}" for server in shards),
        "GRADQ_JOB_ID": job_id,
        "GRADQ_ELASTIC_HOSTS": "2",
        "GRADQ_BITS": "4",
        "GRADQ_ERROR_FEEDBACK": "1",
        "OMP_NUM_THREADS": "1",
        **(variables or {}),
    }
    command = [sys.executable, str(EXAMPLE), "--data-seed", str(seed), "--sync-every", str(SYNC_EVERY)]
    command += ["--bucket-elements", str(BUCKET_ELEMENTS), "--report", str(out), *args]
    log = (out / f"host{seed}.log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


@pytest.mark.parametrize("variables", [{}, SPARSE], ids=["4-bit", "sparse"])
def test_two_shards_each_keep_their_keys_and_the_hosts_stay_bit_identical(
    shards: list[AggregatorServer], tmp_path: Path, variables: dict[str, str]
) -> None:
    rounds = 4
    # The hosts start from different weights: every shard's first seed is the job's, and the others adopt it.
    processes = [
        start(
            shards,
            "diloco-shards",
            seed,
            tmp_path,
            "--rounds",
            str(rounds),
            "--init-seed",
            str(seed),
            variables=variables,
        )
        for seed in range(2)
    ]
    hosts = finish(processes, tmp_path, range(2))
    digests = [host.figures["digests"] for host in hosts]
    assert sorted(digests[0], key=int) == [str(round_) for round_ in range(1, rounds + 1)]
    assert digests[0] == digests[1] and len(set(digests[0].values())) == rounds
    assert_identical(hosts)
    assert [host.figures["matches_aggregator"] for host in hosts] == [True, True]  # both shards' copies
    assert all(server.table.counters["contributions"] > 0 for server in shards)  # both shards carried rounds
    losses = hosts[0].figures["losses"]
    assert sum(losses[-SYNC_EVERY:]) < sum(losses[:SYNC_EVERY])  # it learns


def test_a_shard_restarted_alone_is_seeded_again_and_still_finds_a_host_that_dies(
    shards: list[AggregatorServer], start_aggregator: StartAggregator, tmp_path: Path
) -> None:
    rounds = 10
    common = ("--rounds", str(rounds), "--step-delay", "0.01")
    progress = tmp_path / "progress"
    processes = [
        start(shards, "diloco-shard-restart", 0, tmp_path, *common, "--progress", str(progress)),
        start(shards, "diloco-shard-restart", 1, tmp_path, *common, "--die-in-round", "5"),
    ]
    wait_for_round(progress, 2, processes[0], tmp_path / "host0.log")
    port = shards[1].port
    shards[1].stop()  # shard 1 alone forgets its keys' global state, momentum, rounds and members
    shards[1] = start_aggregator(SHARD_POLICY, address=f"127.0.0.1:{port}")
    assert processes[1].wait(timeout=RUN_TIMEOUT_S) == -9  # SIGKILLed during round 5
    # The restarted shard watches the hosts that came back: it drops the dead one at once, as shard 0 does, and
    # the survivor trains on (a shard that missed it would hold round 5 to its 60 s deadline and fail it).
    (survivor,) = finish(processes[:1], tmp_path, (0,))

    log = (tmp_path / "host0.log").read_text()
    assert "seeding it with this host's global state" in log
    assert survivor.figures["outer_round"] == rounds
    assert max(survivor.figures["stalls"]) < 30, survivor.figures["stalls"]
    assert survivor.figures["matches_aggregator"]  # the restarted shard's copy too


def test_a_joiner_takes_every_shards_part_of_the_global_state(shards: list[AggregatorServer], tmp_path: Path) -> None:
    rounds = 30  # the survivor trains on alone: long enough for the joiner's start-up (torch's import)
    common = ("--rounds", str(rounds), "--step-delay", "0.03")
    progress = tmp_path / "progress"
    processes = [
        start(shards, "diloco-shard-joiner", 0, tmp_path, *common, "--progress", str(progress)),
        start(shards, "diloco-shard-joiner", 1, tmp_path, *common, "--die-in-round", "2"),
    ]
    assert processes[1].wait(timeout=RUN_TIMEOUT_S) == -9  # SIGKILLed during round 2
    wait_for_round(progress, 4, processes[0], tmp_path / "host0.log")
    joiner = start(shards, "diloco-shard-joiner", 2, tmp_path, *common)  # no donor: both shards send their part
    hosts = finish([processes[0], joiner], tmp_path, (0, 2))

    joined_at = hosts[1].figures["joined_at_round"]
    assert 4 <= joined_at < rounds
    after = {key: value for key, value in hosts[0].figures["digests"].items() if int(key) > joined_at}
    assert hosts[1].figures["digests"] == after  # from its first outer round on, the survivor's, bit for bit
    assert_identical(hosts)
    assert [host.figures["matches_aggregator"] for host in hosts] == [True, True]
