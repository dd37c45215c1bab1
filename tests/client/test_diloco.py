"""DiLoCo through a real aggregator: hosts as real processes (examples/diloco_train.py), H=10 inner steps per round.

Each host is one process with a process group of its own, training the
character transformer on its own data; the aggregator averages the hosts'
4-bit pseudo-gradients (with error feedback) once per outer round. Every host
reports the digest of its global parameters after each round.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from waiting import wait_until

from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "diloco_train.py"
SYNC_EVERY = 10
RUN_TIMEOUT_S = 300
StartAggregator = Callable[..., AggregatorServer]  # the start_aggregator fixture (tests/conftest.py)


@pytest.fixture(scope="module")
def aggregator() -> Iterator[AggregatorServer]:
    # The hosts' error feedback is what a checkpoint carries; the aggregator's own would restart from zero.
    policy = RoundPolicy(round_timeout_s=60.0, server_error_feedback=False)
    server = AggregatorServer(policy, ServerOptions("127.0.0.1:0"))
    server.start()
    yield server
    server.stop()


@dataclass
class Host:
    figures: dict[str, Any]
    global_parameters: list[torch.Tensor]


# The variables of a host pushing sparse pseudo-gradients instead of the default 4-bit ones.
SPARSE = {"GRADQ_SCHEME": "sparse_topk"}


def start(
    aggregator: AggregatorServer,
    job_id: str,
    seed: int,
    out: Path,
    *args: str,
    hosts: int = 3,
    variables: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}",
        "GRADQ_JOB_ID": job_id,
        "GRADQ_ELASTIC_HOSTS": str(hosts),
        "GRADQ_BITS": "4",
        "GRADQ_ERROR_FEEDBACK": "1",
        "OMP_NUM_THREADS": "1",
        **(variables or {}),
    }
    command = [sys.executable, str(EXAMPLE), "--data-seed", str(seed), "--sync-every", str(SYNC_EVERY)]
    log = (out / f"host{seed}.log").open("w")
    return subprocess.Popen(
        [*command, "--report", str(out), *args], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
    )


def finish(processes: Sequence[subprocess.Popen[bytes]], out: Path, seeds: Sequence[int]) -> list[Host]:
    codes = [process.wait(timeout=RUN_TIMEOUT_S) for process in processes]
    assert codes == [0] * len(processes), "\n".join((out / f"host{seed}.log").read_text()[-3000:] for seed in seeds)
    return [
        Host(json.loads((out / f"host{seed}.json").read_text()), torch.load(out / f"host{seed}.pt")) for seed in seeds
    ]


def train(aggregator: AggregatorServer, job_id: str, out: Path, *args: str) -> list[Host]:
    out.mkdir(parents=True, exist_ok=True)
    return finish([start(aggregator, job_id, seed, out, *args) for seed in range(3)], out, range(3))


def round_of(progress: Path) -> int:
    """The outer round a host's ``--progress`` file names; -1 before it names one."""
    text = progress.read_text() if progress.exists() else ""
    return int(text) if text else -1


def wait_for_round(progress: Path, at_least: int, process: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until the host writing ``progress`` is at outer round ``at_least``; fail at once if it exits.

    Raises:
        AssertionError: it exited first, or did not get there within RUN_TIMEOUT_S; with its log's tail.
    """
    wait_until(
        lambda: round_of(progress) >= at_least,
        f"the host at outer round {at_least}",
        RUN_TIMEOUT_S,
        alive=lambda: process.poll() is None,
        detail=lambda: log.read_text()[-3000:],
    )


def assert_identical(hosts: Sequence[Host]) -> None:
    for host in hosts[1:]:
        for mine, theirs in zip(hosts[0].global_parameters, host.global_parameters, strict=True):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("outer_step", ["aggregator", "hosts"])
def test_every_outer_round_leaves_the_hosts_bit_identical(
    aggregator: AggregatorServer, tmp_path: Path, outer_step: str
) -> None:
    rounds = 5
    out = tmp_path
    out.mkdir(parents=True, exist_ok=True)
    # On the aggregator, the hosts may start from different weights: they all take the first seed's.
    processes = [
        start(
            aggregator,
            f"diloco-sync-{outer_step}",
            seed,
            out,
            "--rounds",
            str(rounds),
            "--outer-step",
            outer_step,
            "--init-seed",
            str(seed if outer_step == "aggregator" else 0),
        )
        for seed in range(3)
    ]
    hosts = finish(processes, out, range(3))

    digests = [host.figures["digests"] for host in hosts]
    assert sorted(digests[0], key=int) == [str(round_) for round_ in range(1, rounds + 1)]
    assert digests[0] == digests[1] == digests[2]  # after every round, not only the last
    assert_identical(hosts)
    assert len(set(digests[0].values())) == rounds  # the global parameters moved every round
    losses = hosts[0].figures["losses"]
    assert sum(losses[-SYNC_EVERY:]) < sum(losses[:SYNC_EVERY]) - 0.5 * SYNC_EVERY  # it learns
    # One 4-bit copy of the model each way per outer round, not per inner step.
    parameters = sum(values.numel() for values in hosts[0].global_parameters)
    per_round = hosts[0].figures["bytes_sent"] / rounds
    assert parameters * 4 / 8 <= per_round <= parameters * 4 / 8 * 1.25
    # The aggregator's copy of the global state is every host's, bit for bit (it holds none of its own on "hosts").
    assert [host.figures["matches_aggregator"] for host in hosts] == [outer_step == "aggregator"] * 3


def test_an_aggregator_restart_loses_no_training(
    aggregator: AggregatorServer, start_aggregator: StartAggregator, tmp_path: Path
) -> None:
    # Two hosts, so that the sums agree bit for bit whatever the order of arrival (see the checkpoint test).
    seeds, rounds = range(2), 6
    common = ("--rounds", str(rounds), "--step-delay", "0.01")
    (tmp_path / "steady").mkdir()
    steady = finish(
        [start(aggregator, "diloco-steady", seed, tmp_path / "steady", *common, hosts=2) for seed in seeds],
        tmp_path / "steady",
        seeds,
    )
    policy = RoundPolicy(round_timeout_s=60.0, server_error_feedback=False)
    restarted = start_aggregator(policy)
    port = restarted.port
    out, progress = tmp_path / "restarted", tmp_path / "progress"
    out.mkdir()
    processes = [
        start(restarted, "diloco-restart", 0, out, *common, "--progress", str(progress), hosts=2),
        start(restarted, "diloco-restart", 1, out, *common, hosts=2),
    ]
    wait_for_round(progress, 2, processes[0], out / "host0.log")
    restarted.stop()  # everything the aggregator held is gone: the global state, the momentum, the rounds
    start_aggregator(policy, address=f"127.0.0.1:{port}")
    hosts = finish(processes, out, seeds)

    digests = [host.figures["digests"] for host in hosts]
    both_took = set(digests[0]) & set(digests[1])  # the rounds both hosts took are identical
    assert len(both_took) >= rounds - 1 and all(digests[0][k] == digests[1][k] for k in both_took)
    for host, same in zip(hosts, steady, strict=True):
        # Before the restart, bit for bit the uninterrupted run; after it, the same training.
        assert {k: host.figures["digests"][k] for k in ("1", "2")} == {
            k: same.figures["digests"][k] for k in ("1", "2")
        }
        held_out, reference = host.figures["held_out_loss"], same.figures["held_out_loss"]
        assert abs(held_out - reference) <= 0.05 * reference, (held_out, reference)
        assert host.figures["matches_aggregator"]  # the new aggregator was seeded with the hosts' state
    assert "seeding it with this host's global state" in (out / "host0.log").read_text()


def test_a_checkpoint_resumes_exactly(aggregator: AggregatorServer, tmp_path: Path) -> None:
    # Two hosts: the aggregator sums contributions in the order they arrive, and a sum of two is the same in
    # either order, so two runs of the same rounds agree bit for bit (with three, only to fp32 rounding).
    seeds = range(2)

    def run(job_id: str, out: Path, *args: str) -> list[Host]:
        out.mkdir()
        return finish(
            [start(aggregator, job_id, seed, out, "--rounds", "4", *args, hosts=2) for seed in seeds], out, seeds
        )

    whole = run("diloco-whole", tmp_path / "whole")
    checkpoint = [f"{tmp_path}/checkpoint{seed}.pt" for seed in seeds]
    processes = []
    (tmp_path / "first").mkdir()
    for seed in seeds:
        saving = ("--rounds", "4", "--save-at-round", "2", "--checkpoint", checkpoint[seed])
        processes.append(start(aggregator, "diloco-resumed", seed, tmp_path / "first", *saving, hosts=2))
    finish(processes, tmp_path / "first", seeds)
    processes = []
    (tmp_path / "second").mkdir()
    for seed in seeds:
        resuming = ("--rounds", "4", "--resume", "--checkpoint", checkpoint[seed])
        processes.append(start(aggregator, "diloco-resumed", seed, tmp_path / "second", *resuming, hosts=2))
    resumed = finish(processes, tmp_path / "second", seeds)

    for uninterrupted, again in zip(whole, resumed, strict=True):
        assert again.figures["losses"] == uninterrupted.figures["losses"][2 * SYNC_EVERY :]
        later = {key: value for key, value in uninterrupted.figures["digests"].items() if int(key) > 2}
        assert again.figures["digests"] == later
        for mine, theirs in zip(uninterrupted.global_parameters, again.global_parameters, strict=True):
            assert torch.equal(mine, theirs)


def test_sparse_pseudo_gradients_keep_hosts_aggregator_and_a_joiner_bit_identical(
    start_aggregator: StartAggregator, tmp_path: Path
) -> None:
    # The default policy: the aggregator re-sparsifies each mean with error feedback of its own.
    aggregator = start_aggregator(RoundPolicy(round_timeout_s=60.0))
    rounds = 30
    common = ("--rounds", str(rounds), "--step-delay", "0.01")
    progress = tmp_path / "progress"
    first = [
        start(
            aggregator, "diloco-sparse", 0, tmp_path, *common, "--progress", str(progress), hosts=2, variables=SPARSE
        ),
        start(aggregator, "diloco-sparse", 1, tmp_path, *common, "--init-seed", "1", hosts=2, variables=SPARSE),
    ]
    wait_for_round(progress, 2, first[0], tmp_path / "host0.log")
    joiner = start(aggregator, "diloco-sparse", 2, tmp_path, *common, hosts=2, variables=SPARSE)
    hosts = finish([*first, joiner], tmp_path, range(3))

    digests = [host.figures["digests"] for host in hosts[:2]]
    assert sorted(digests[0], key=int) == [str(round_) for round_ in range(1, rounds + 1)]
    assert digests[0] == digests[1] and len(set(digests[0].values())) == rounds  # moved every round, alike
    joined_at = hosts[2].figures["joined_at_round"]
    assert 2 <= joined_at < rounds
    after = {key: value for key, value in digests[0].items() if int(key) > joined_at}
    assert hosts[2].figures["digests"] == after  # the joiner's, bit for bit, from its first outer round on
    assert_identical(hosts)
    assert [host.figures["matches_aggregator"] for host in hosts] == [True] * 3
    # A sparse copy each way per round: under a third of a bit per parameter up (the small model's short
    # last chunks keep their 64 entries too), against 4 for the default.
    parameters = sum(values.numel() for values in hosts[0].global_parameters)
    assert hosts[0].figures["bytes_sent"] / rounds <= parameters * 0.35 / 8
    losses = hosts[0].figures["losses"]
    assert sum(losses[-SYNC_EVERY:]) < sum(losses[:SYNC_EVERY])  # it learns


def test_a_host_killed_mid_round_is_dropped_and_a_later_joiner_is_identical_after_its_first_round(
    aggregator: AggregatorServer, tmp_path: Path
) -> None:
    rounds = 30
    common = ("--rounds", str(rounds), "--step-delay", "0.01")
    progress = tmp_path / "progress"
    processes = [
        start(aggregator, "diloco-elastic", 0, tmp_path, *common, "--progress", str(progress)),
        start(aggregator, "diloco-elastic", 1, tmp_path, *common),
        start(aggregator, "diloco-elastic", 2, tmp_path, *common, "--die-in-round", "2"),
    ]
    assert processes[2].wait(timeout=RUN_TIMEOUT_S) == -9  # SIGKILLed during round 2
    wait_for_round(progress, 4, processes[0], tmp_path / "host0.log")
    joiner = start(aggregator, "diloco-elastic", 3, tmp_path, *common)
    hosts = finish([processes[0], processes[1], joiner], tmp_path, (0, 1, 3))

    assert hosts[0].figures["outer_round"] == hosts[1].figures["outer_round"] == rounds  # the survivors went on
    assert hosts[0].figures["digests"] == hosts[1].figures["digests"]
    joined_at = hosts[2].figures["joined_at_round"]
    assert 4 <= joined_at < rounds
    # From its first outer round on, the joiner's global parameters are the others', bit for bit.
    after = {key: value for key, value in hosts[0].figures["digests"].items() if int(key) > joined_at}
    assert hosts[2].figures["digests"] == after
    assert_identical(hosts)


def test_a_host_silent_past_the_keepalive_is_dropped_and_rejoins_by_itself(
    aggregator: AggregatorServer, tmp_path: Path
) -> None:
    common = ("--rounds", "30", "--step-delay", "0.01")
    progress = tmp_path / "progress"
    processes = [
        start(aggregator, "diloco-silent", 0, tmp_path, *common, "--progress", str(progress)),
        *(start(aggregator, "diloco-silent", seed, tmp_path, *common) for seed in (1, 2)),
    ]

    wait_for_round(progress, 3, processes[0], tmp_path / "host0.log")
    os.kill(processes[2].pid, signal.SIGSTOP)  # a hung host: its connections stay open, it answers nothing
    stopped_at = round_of(progress)
    try:
        # The others go on: it was dropped (a round waits for every member).
        wait_for_round(progress, stopped_at + 3, processes[0], tmp_path / "host0.log")
    finally:
        os.kill(processes[2].pid, signal.SIGCONT)
    hosts = finish(processes, tmp_path, range(3))

    assert hosts[2].figures["rejoins"] == 1  # it found itself dropped and joined again, by itself
    assert hosts[0].figures["digests"] == hosts[1].figures["digests"]
    assert_identical(hosts)  # it ended on the others' global parameters, bit for bit
    back = min(int(key) for key in hosts[2].figures["digests"] if int(key) > stopped_at + 1)
    later = {key: value for key, value in hosts[0].figures["digests"].items() if int(key) >= back}
    assert {key: value for key, value in hosts[2].figures["digests"].items() if int(key) >= back} == later


# Streaming DiLoCo (gradq.client.diloco.fragments): the ~100k parameters as 5 or 6 round keys in two fragments,
# each round in flight for two inner steps, the host keeping half its own parameters where an update lands.
STREAMING = ("--bucket-elements", "20000", "--fragments", "2", "--fragment-delay", "2", "--fragment-alpha", "0.5")


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "fragments"])
def test_semi_sync_a_slow_host_stalls_the_others_no_longer_than_the_grace_window_and_is_merged(
    aggregator: AggregatorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, streaming: bool
) -> None:
    grace, fast, slow = 0.2, 0.05, 0.17  # seconds slept per inner step: the slow host takes over 3x as long
    semi = ("--quorum", "2", "--grace", str(grace), *(STREAMING if streaming else ()))
    with caplog.at_level(logging.INFO, logger="gradq.server.round_closing"):
        processes = [
            start(
                aggregator, f"diloco-semi-{streaming}", 0, tmp_path, *semi, "--rounds", "8", "--step-delay", str(fast)
            ),
            start(
                aggregator, f"diloco-semi-{streaming}", 1, tmp_path, *semi, "--rounds", "8", "--step-delay", str(fast)
            ),
            # It stops sooner: a host late for the job's last round would wait for a boundary that never comes.
            start(
                aggregator, f"diloco-semi-{streaming}", 2, tmp_path, *semi, "--rounds", "5", "--step-delay", str(slow)
            ),
        ]
        hosts = finish(processes, tmp_path, range(3))

    assert hosts[0].figures["outer_round"] == hosts[1].figures["outer_round"] == 8
    assert hosts[0].figures["digests"] == hosts[1].figures["digests"]
    # A synchronous round would hold the fast hosts about (slow - fast) x 10 = 1.2 s each time for the slow one.
    stalls = hosts[0].figures["stalls"][1:] + hosts[1].figures["stalls"][1:]  # the first waits for the job to form
    assert max(stalls) < grace + 0.6, stalls
    slow_host = hosts[2].figures
    assert slow_host["late_rounds"] >= 1
    assert "merged the late pushes of members" in caplog.text  # its pseudo-gradients counted, not dropped
    # After every catch-up the slow host holds the job's global parameters, bit for bit.
    caught_up = {key: value for key, value in slow_host["digests"].items() if int(key) > 1}
    assert caught_up and all(hosts[0].figures["digests"][key] == value for key, value in caught_up.items())


@pytest.mark.parametrize("inside", ["fsdp", "ddp"])
def test_hosts_of_two_ranks_push_one_copy_and_every_round_leaves_them_bit_identical(
    aggregator: AggregatorServer, tmp_path: Path, inside: str
) -> None:
    # Two hosts of two ranks each (one torchrun per host): the model sharded over a host's ranks with FSDP2
    # (each rank pushes its own shards), or replicated by DDP (the ranks sum, then push a piece each). A third
    # host joins later and takes the global state from the aggregator.
    def host(seed: int, *args: str) -> subprocess.Popen[bytes]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        command = [*torchrun, str(EXAMPLE), "--inside", inside, "--data-seed", str(seed), "--sync-every", "5"]
        env = {
            **os.environ,
            "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}",
            "GRADQ_JOB_ID": f"diloco-{inside}",
            "GRADQ_ELASTIC_HOSTS": "2",
            "GRADQ_BITS": "4",
            "GRADQ_ERROR_FEEDBACK": "1",
            "OMP_NUM_THREADS": "1",
        }
        log = (tmp_path / f"host{seed}.log").open("w")
        return subprocess.Popen(
            [*command, "--report", str(tmp_path), *args], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )

    progress = tmp_path / "progress"
    processes = [
        host(0, "--rounds", "40", "--step-delay", "0.08", "--progress", str(progress)),
        host(1, "--rounds", "40", "--step-delay", "0.08"),
    ]
    wait_for_round(progress, 3, processes[0], tmp_path / "host0.log")
    processes.append(host(2, "--rounds", "40", "--step-delay", "0.08"))
    codes = [process.wait(timeout=RUN_TIMEOUT_S) for process in processes]
    assert codes == [0, 0, 0], "\n".join((tmp_path / f"host{seed}.log").read_text()[-3000:] for seed in range(3))

    figures = {
        (seed, rank): json.loads((tmp_path / f"host{seed}-rank{rank}.json").read_text())
        for seed in range(3)
        for rank in range(2)
    }
    shards = {
        (seed, rank): torch.load(tmp_path / f"host{seed}-rank{rank}.pt") for seed in range(3) for rank in range(2)
    }
    for rank in range(2):  # each local rank holds the same shard on every host
        assert figures[(0, rank)]["digests"] == figures[(1, rank)]["digests"]
        assert sorted(figures[(0, rank)]["digests"], key=int) == [str(r) for r in range(1, 41)]
        joined_at = figures[(2, rank)]["joined_at_round"]
        assert 3 <= joined_at < 40
        after = {key: value for key, value in figures[(0, rank)]["digests"].items() if int(key) > joined_at}
        assert figures[(2, rank)]["digests"] == after  # from its first round on, the joiner's shards are theirs
        for seed in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(shards[(0, rank)], shards[(seed, rank)], strict=True))
    assert all(figure["matches_aggregator"] for figure in figures.values())
    # FSDP2: the two ranks of a host hold different shards (the host pushes one copy of the model between
    # them); DDP: the same replica.
    same = figures[(0, 0)]["digests"]["1"] == figures[(0, 1)]["digests"]["1"]
    assert same == (inside == "ddp")
    losses = figures[(0, 0)]["losses"]
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns
